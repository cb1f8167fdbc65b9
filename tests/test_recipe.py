"""Recipes: validation errors name the file, the key and what was expected."""

import pytest
from pydantic import ValidationError

from tasks.formats.recipe import load_recipe, parse_recipe
from tasks.formats.recipe_base import RecipeError

GOOD = """
dataset: cats
storage: ./store
sources:
  - name: web
    manifest: manifests/web.csv
    extra_columns: [author]
download:
  timeout_s: 5
"""


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_good_recipe_resolves_relative_paths_against_its_folder(tmp_path):
    r = load_recipe(write(tmp_path, GOOD))
    assert r.dataset == "cats"
    assert r.storage == str(tmp_path / "store")
    assert r.sources[0].manifest == str(tmp_path / "manifests/web.csv")
    assert r.sources[0].extra_columns == ("author",)
    assert r.download.timeout_s == 5
    assert r.download.retries == 2  # default kept


def test_stage_configs_are_frozen(tmp_path):
    r = load_recipe(write(tmp_path, GOOD))
    with pytest.raises(ValidationError):
        r.download.timeout_s = 1


@pytest.mark.parametrize(
    ("patch", "fragment"),
    [
        ("download:\n  timeout_s: -1\n", "download.timeout_s: Input should be greater than 0 (got -1)"),
        ("download:\n  max_inflight: lots\n", "download.max_inflight: Input should be a valid integer"),
        ("download:\n  timeoutt_s: 5\n", "download.timeoutt_s: Extra inputs are not permitted"),
        ("execution:\n  workers: 0\n", "execution.workers: Input should be greater than or equal to 1"),
        ("download:\n  network:\n    allowed_networks: ['not-a-cidr']\n", "download.network.allowed_networks"),
    ],
)
def test_errors_name_file_key_and_expectation(tmp_path, patch, fragment):
    text = GOOD.replace("download:\n  timeout_s: 5\n", "") + patch
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, text))
    assert str(tmp_path / "r.yaml") in str(err.value)
    assert fragment in str(err.value)


def test_bad_source_names_and_duplicates(tmp_path):
    bad = GOOD.replace("name: web", "name: Web.Site")
    with pytest.raises(RecipeError, match=r"sources\.0\.name: String should match pattern"):
        load_recipe(write(tmp_path, bad))
    dup = GOOD + "  - name: web\n    manifest: other.csv\n"
    dup = dup.replace("download:\n  timeout_s: 5\n", "")
    with pytest.raises(RecipeError, match="source names must be unique, repeated: web"):
        load_recipe(write(tmp_path, dup))


def test_missing_required_keys(tmp_path):
    with pytest.raises(RecipeError, match=r"r\.yaml: sources: Field required"):
        load_recipe(write(tmp_path, "dataset: x\nstorage: s\n"))


def test_yaml_syntax_error_names_the_line(tmp_path):
    with pytest.raises(RecipeError, match=r"r\.yaml:3: not valid YAML"):
        load_recipe(write(tmp_path, "dataset: x\nstorage: s\n\tsources: []\n"))


def test_unreadable_file(tmp_path):
    with pytest.raises(RecipeError, match="cannot read recipe"):
        load_recipe(tmp_path / "nope.yaml")


def test_environment_variables_and_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("DATA", "/data")
    text = GOOD.replace("./store", "${DATA}/store").replace("manifests/web.csv", "${MISSING:-/m}/web.csv")
    r = load_recipe(write(tmp_path, text))
    assert r.storage == "/data/store"
    assert r.sources[0].manifest == "/m/web.csv"
    monkeypatch.delenv("DATA")
    with pytest.raises(RecipeError, match="storage: environment variable DATA is not set"):
        load_recipe(write(tmp_path, text))


def test_overrides_use_dotted_keys(tmp_path):
    r = load_recipe(
        write(tmp_path, GOOD), {"download.retries": 5, "execution.cluster": "tcp://h:8786", "storage": "s3://b/p"}
    )
    assert (r.download.retries, r.execution.cluster, r.storage) == (5, "tcp://h:8786", "s3://b/p")
    with pytest.raises(RecipeError, match="download.retries: Input should be less than or equal to 10"):
        load_recipe(write(tmp_path, GOOD), {"download.retries": 99})


def test_recipe_hash_changes_with_content(tmp_path):
    a = load_recipe(write(tmp_path, GOOD))
    b = load_recipe(write(tmp_path, GOOD), {"download.retries": 3})
    assert a.recipe_hash() != b.recipe_hash()
    assert a.recipe_hash() == load_recipe(write(tmp_path, GOOD)).recipe_hash()


def test_recipe_hash_leaves_out_where_and_how_it_runs(tmp_path):
    """Same content, another store or cluster: the same release fingerprint, so no new release."""
    a = load_recipe(write(tmp_path, GOOD))
    moved = load_recipe(
        write(tmp_path, GOOD), {"storage": "s3://b/p", "execution.workers": 7, "execution.cluster": "tcp://h:8786"}
    )
    assert a.recipe_hash() == moved.recipe_hash()


def test_credentials_in_storage_options_never_reach_prefects_records(prefect_harness):
    """The phase flows take the recipe as a parameter, and Prefect records every flow run's
    parameters (its UI and API show them): the storage credentials are masked there, while the
    flow itself gets them whole."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.context import get_run_context

    from tasks.formats.recipe import MASKED

    options = {
        "key": "AKIAEXAMPLEKEY",
        "secret": "verySecretValue42",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "aws_session_token": "tok-123"},
    }
    recipe = parse_recipe(
        {
            "dataset": "d",
            "storage": "s3://b/p",
            "storage_options": options,
            "sources": [{"name": "s", "manifest": "m.csv"}],
        }
    )

    @flow(validate_parameters=False)
    def phase(recipe):
        return str(get_run_context().flow_run.id), recipe.storage_options

    run_id, seen = phase(recipe)
    assert seen == options  # the flow works with the real credentials

    async def recorded():
        async with get_client() as client:
            return (await client.read_flow_run(run_id)).parameters

    import asyncio

    stored = asyncio.run(recorded())["recipe"]["storage_options"]
    assert stored == {
        "key": MASKED,
        "secret": MASKED,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "aws_session_token": MASKED},
    }
    assert (
        "verySecretValue42" not in str(stored)
        and recipe.recipe_hash()
        == parse_recipe(
            {"dataset": "d", "storage": "s3://b/p", "sources": [{"name": "s", "manifest": "m.csv"}]}
        ).recipe_hash()
    )
