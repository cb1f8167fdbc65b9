"""The fine-tuning dataset end to end: records, images, tiles, tags, packs, gates, its own release."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture(scope="module")
def released(tmp_path_factory, prefect_harness, dask_address):
    from flows.finetuning import finetuning_flow
    from tasks.demo.finetune import write_finetune_corpus

    root = tmp_path_factory.mktemp("ftdemo")
    expected = write_finetune_corpus(root, n=20, text_only=10)
    # The runs use the session's cluster (tests/conftest.py), not one each.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDSMITH_DEMO_DIR", str(root))
        packed = finetuning_flow(recipe_path=str(RECIPES / "demo-finetune.yaml"), cluster=dask_address)
        # The second run names its cluster as the compose stack's worker does: SHARDSMITH_CLUSTER.
        mp.setenv("SHARDSMITH_CLUSTER", dask_address)
        before = _tasks_run(dask_address)
        unpacked = finetuning_flow(
            recipe_path=str(RECIPES / "demo-finetune.yaml"),
            # Small byte ranges: the records file is read by several tasks in this run.
            overrides={
                "finetune.packing.packed": False,
                "finetune.tiling.store": "grid",
                "finetune.conversation.range_bytes": 1024,
            },
        )
        assert _tasks_run(dask_address) > before  # its tasks ran there, not on a cluster of its own
    return root / "store" / "demo-finetune", packed, unpacked, expected


def _tasks_run(address: str) -> int:
    """Tasks the workers of the cluster at ``address`` have run so far."""
    from distributed import Client

    with Client(address) as client:
        return sum(client.run(lambda dask_worker: dask_worker.state.executed_count).values())


def _samples(tar: Path):
    from tasks.formats.shards import iter_samples

    with tar.open("rb") as fh:
        yield from iter_samples(fh)


def test_every_record_is_one_ledger_row_with_its_reason(released):
    store, packed, _, expected = released
    base = store / "releases" / packed["release"].version
    ledger = pq.read_table(base / "ledger.parquet")
    assert ledger.num_rows == sum(expected["records"].values())
    assert len(set(ledger.column("key").to_pylist())) == ledger.num_rows
    reasons = Counter(r for r in ledger.column("reason").to_pylist() if r)
    for reason, n in expected["by_reason"].items():
        assert reasons[reason] == n, (reason, reasons)
    # Demo images without an allowed license fail validation; their records follow them.
    assert reasons["image_rejected"] >= 1
    details = [
        d
        for d, r in zip(ledger.column("detail").to_pylist(), ledger.column("reason").to_pylist())
        if r == "image_rejected"
    ]
    assert all("license" in d or "duplicate_of" in d for d in details)


def test_personal_data_in_any_turn_is_recorded_and_redacted_in_the_release(released):
    """The planted address sits in text-only records' questions, turns no image's caption
    holds: each such record's ledger row says what was found and done, the release holds a
    placeholder and never the address, and the report counts them."""
    from tasks.demo.finetune import PERSONAL_ADDRESS, PERSONAL_EVERY, PERSONAL_FIRST

    store, packed, _, expected = released
    base = store / "releases" / packed["release"].version
    rows = {r["id"]: r for r in pq.read_table(base / "ledger.parquet").to_pylist()}
    planted = {f"txt-{i:04d}" for i in range(PERSONAL_FIRST, expected["records"]["text"], PERSONAL_EVERY)}
    assert {(rows[i]["personal_data"], rows[i]["privacy"]) for i in planted} == {("email", "redacted")}
    kept = [i for i in planted if rows[i]["status"] == "ok"]
    assert packed["finetune"].privacy == {"with_personal_data": len(planted), "redacted": len(kept), "refused": 0}
    assert kept and all(rows[i]["detail"].startswith("redacted: turn 0: email") for i in kept)
    assert {r["personal_data"] for i, r in rows.items() if i not in planted and r["status"] == "ok"} == {""}
    texts = [s.members["json"].decode() for tar in sorted(base.glob("**/*.tar")) for s in _samples(tar)]
    assert any("<EMAIL>" in t for t in texts) and not any(PERSONAL_ADDRESS in t for t in texts)
    report = sorted((store / "reports").glob("*/report.html"), key=lambda p: p.stat().st_mtime)[0].read_text()
    assert "texts scanned for personal data" in report and "released redacted" in report


def test_every_phase_of_the_run_reports_its_rate(released):
    # The packing step's row (phase "reshard") said 0 samples/s for packs it had just written.
    store, packed, _, _ = released
    runs = sorted((store / "reports").glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    first = json.loads(runs[0].read_text())  # the packed run, which did every phase's work
    rates = {row["phase"]: row["samples_per_s"] for row in first["phases"]}
    assert {"download", "validate", "reshard", "finetune"} <= set(rates), rates
    assert all(rate > 0 for rate in rates.values()), rates


def test_records_read_in_byte_ranges_keep_their_keys_and_reasons(released):
    store, packed, unpacked, expected = released
    ranges = sorted(store.glob("finetune/records/chat/*/0000[0-9].json"))
    assert len({p.parent for p in ranges}) == 2 and len(ranges) > 3  # one range, then several

    def ingest_reasons(version):
        ledger = pq.read_table(store / "releases" / version / "ledger.parquet").to_pylist()
        return {r["key"]: (r["reason"], r["detail"]) for r in ledger if r["reason"] in expected["by_reason"]}

    whole, split = ingest_reasons(packed["release"].version), ingest_reasons(unpacked["release"].version)
    assert whole == split and sum(expected["by_reason"].values()) == len(whole)
    assert all(d.startswith("byte ") for r, d in whole.values() if r == "unparsable_row")


def test_packs_hold_every_accepted_sample_once_within_limits(released):
    store, packed, _, _ = released
    base = store / "releases" / packed["release"].version
    index = json.loads((base / "index.json").read_text())
    assert index["kind"] == "finetuning" and index["schema"]["packed"] is True
    schema = index["schema"]
    assert (
        schema["tile_size"] == 448
        and schema["tokens_per_tile"] == 256
        and "<tile_global_thumbnail>" in schema["tags"]["all"]
    )
    ledger = pq.read_table(base / "ledger.parquet").to_pylist()
    ok = {r["key"] for r in ledger if r["status"] == "ok"}
    seen: list[str] = []
    fills = []
    for shard in index["shards"]:
        for s in _samples(base / shard["name"]):
            doc = json.loads(s.members["json"])
            assert s.key == doc["pack"] and s.key.startswith("pack-")
            assert doc["tokens"] <= schema["budget"] and doc["images"] <= schema["max_images"]
            lengths = [x["tokens"]["total"] for x in doc["samples"]]
            assert doc["cu_seqlens"] == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
            for pos, sample in enumerate(doc["samples"]):
                seen.append(sample["key"])
                text = " ".join(t["value"] for t in sample["conversations"])
                assert text.count("<img>") == len(sample["images"]) and "<image>" not in text
                for img in sample["images"]:
                    assert img["member"].startswith(f"s{pos:03d}.") and img["member"] in s.members
                    rows, cols = img["grid"]
                    assert rows * cols <= 6 and img["tiles"] == rows * cols + (rows * cols > 1)
                    assert len(img["tile_members"]) == img["tiles"] and all(t in s.members for t in img["tile_members"])
                    assert text.count(f"<tile_{rows * cols}>") >= 1
            fills.append(doc["tokens"] / schema["budget"])
    assert sorted(seen) == sorted(ok)  # each accepted sample in exactly one pack
    assert sum(fills) / len(fills) == pytest.approx(index["packing"]["fill_ratio"], abs=1e-4)
    assert index["packing"]["fill_ratio"] > index["packing"]["pad_to_longest_ratio"]
    assert index["gates"]["finetune"]["success"] and index["gates"]["validate"]["success"]
    html = (base / "report.html").read_text()
    assert 'data-hist="tokens_text"' in html and 'data-hist="tokens_image"' in html and 'data-hist="images"' in html
    first = index["shards"][0]["name"]
    assert (base / ".nv-meta" / "dataset.yaml").is_file() and (base / first.replace(".tar", ".idx")).is_file()
    # Release shard names carry a digest of the content: unique across releases.
    assert re.fullmatch(r"shard-[0-9a-f]{8}-000000\.tar", first)


def test_unpacked_release_is_a_new_version_with_one_sample_per_record(released):
    store, packed, unpacked, _ = released
    rel = unpacked["release"]
    assert rel.created and rel.version > packed["release"].version
    base = store / "releases" / rel.version
    index = json.loads((base / "index.json").read_text())
    assert index["schema"]["packed"] is False and index["parent"] == packed["release"].version
    for shard in index["shards"]:
        for s in _samples(base / shard["name"]):
            doc = json.loads(s.members["json"])
            assert doc["key"] == s.key and set(doc["tokens"]) == {"text", "image", "total"}
            assert doc["text_only"] == (not doc["images"])
            for img in doc["images"]:
                assert img["tile_members"] is None and img["member"] in s.members


def test_gate_fails_on_over_budget_pack_and_fill():
    from tasks.audit.finetune_gate import finetune_gate
    from tasks.formats.recipe_finetune import FinetuneGate, PackingConfig

    ledger = pa.table({"key": ["a", "b"], "status": ["ok", "ok"], "reason": pa.nulls(2, pa.string())})
    samples = pa.table(
        {
            "key": ["a", "b"],
            "schema_ok": [True, True],
            "tags_ok": [True, False],
            "pack": ["p0", None],
            "text_only": [False, True],
            "personal_data_shown": [False, True],  # one record of two released with personal data
        }
    )
    packs = pa.table({"key": ["p0"], "tokens": [5000], "images": [1], "tiles": [7], "samples": [1]})
    gate = finetune_gate(ledger, samples, packs, FinetuneGate(min_fill_ratio=0.9), PackingConfig(budget=4096))
    failed = {o.name for o in gate.failed}
    assert "no pack over 4096 tokens" in failed
    assert "tag groups equal images" in failed
    assert "every accepted sample in a pack" in failed
    assert "every accepted sample in exactly one pack" in failed
    assert "personal data shown rate <= 0.05" in failed
    assert "fill ratio >= 0.9" not in failed  # 5000 / 4096 is over the minimum


def test_both_fine_tuning_releases_read_back_with_our_loaders(released):
    from loaders.packing import OnlinePacker, finetuning_samples, packed_dataset
    from loaders.release import open_release

    store, packed, unpacked, _ = released
    packs_release = open_release(str(store), version=packed["release"].version, verify=True)
    packs = list(packed_dataset(packs_release, shuffle=False, even="pad"))
    index = json.loads((store / "releases" / packed["release"].version / "index.json").read_text())
    assert len({p["pack"] for p in packs}) == index["totals"]["samples"]
    in_packs = sorted(s["key"] for p in packs for s in p["samples"])
    assert len(in_packs) == len(set(in_packs)) > 0
    plain = open_release(str(store), version=unpacked["release"].version)
    budget, cap = plain.schema["budget"], plain.schema["max_images"]
    online = list(OnlinePacker(finetuning_samples(plain, shuffle=False, even="pad"), budget, cap))
    assert all(p["tokens"] <= budget and p["images"] <= cap for p in online)
    assert sorted(s["key"] for p in online for s in p["samples"]) == in_packs


def test_curation_removes_the_planted_records_and_no_other(released):
    """Replies that describe another picture end low_alignment, copies of earlier records'
    pictures as duplicates (semantic, or pixel-level when pHash catches them first), each with
    its score or original in the detail; curation removes no other record."""
    from tasks.formats.reasons import family

    store, packed, _, expected = released
    ledger = pq.read_table(store / "releases" / packed["release"].version / "ledger.parquet").to_pylist()
    chat = {r["row"]: r for r in ledger if r["source"] == "chat"}
    planted = {e["row"]: e for e in expected["curation"]}
    assert {e["kind"] for e in planted.values()} == {"mismatch", "copy"}
    for row, e in planted.items():
        got = chat[row]
        assert family(got["reason"]) in e["reasons"], (e, got)
        if got["reason"] == "low_alignment":
            assert re.search(r"alignment -?\d\.\d{4} < ", got["detail"]), got
        elif got["reason"].startswith("semantic_duplicate_of:"):
            assert re.search(r"cosine 0\.9\d+ to chat-img-", got["detail"]), got
    curated = {"low_alignment", "semantic_duplicate_of"}
    assert [r["row"] for r in chat.values() if family(r["reason"] or "") in curated and r["row"] not in planted] == []


def test_the_run_summary_says_what_the_turns_privacy_check_did():
    from cli.summary import _details
    from tasks.finetune.outcome import FinetuneSummary, turn_privacy
    from tasks.formats.ledger import Counts

    ledger = pa.table(
        {
            "status": ["ok", "ok", "rejected", "ok"],
            "reason": [None, None, "personal_data", None],
            "personal_data": ["email", "", "phone", None],
            "privacy": ["redacted", None, None, None],
        }
    )
    privacy = turn_privacy(ledger)
    assert privacy == {"with_personal_data": 2, "redacted": 1, "refused": 1}
    stats = {"samples": 3, "packs": 1, "cutoff": 100, "fill_ratio": None}
    summary = FinetuneSummary("d", "r", Counts(4, 3, 1, 0, {"personal_data": 1}, 0), stats, privacy=privacy)
    lines = _details("finetune", {"finetune": summary}, "/store/d")
    assert "privacy: 2 records with personal data in their turns (1 released redacted, 1 refused)" in lines


def test_a_records_file_that_is_not_an_array_fails_the_run_naming_the_file(tmp_path, prefect_harness, dask_address):
    # The range task's own error, not Prefect's "Run is in PENDING state" for the join it fed
    from flows.finetuning import finetuning_flow
    from tasks.finetune.records import RecordsError

    records = tmp_path / "chat.json"
    records.write_text('{"data": [{"id": "a", "conversations": []}]}')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        json.dumps(
            {
                "dataset": "notarray",
                "kind": "finetuning",
                "storage": str(tmp_path / "store"),
                "sources": [{"name": "chat", "manifest": str(records)}],
                "finetune": {"padding": {"cutoff": "fixed", "max_tokens": 2048}},
            }
        )
    )
    with pytest.raises(RecordsError, match=re.escape(f"{records}: the file starts with '{{', expected a JSON array")):
        finetuning_flow(recipe_path=str(recipe), cluster=dask_address)


def test_records_that_show_the_same_picture_share_it_and_a_near_copy_is_refused(
    tmp_path, prefect_harness, dask_address
):
    """LLaVA's conversations reuse COCO's images: validation keeps one copy of a picture and
    refuses the others as exact duplicates, and every record that shows it is released with
    that copy, across chunks, and also when the record that brought it first was refused. A
    near copy (other pixels) is a duplicate sample: refused."""
    import io

    import numpy as np
    from PIL import Image

    from flows.finetuning import finetuning_flow

    rng = np.random.default_rng(3)
    (tmp_path / "images").mkdir()
    noise = (rng.random((120, 160, 3)) * 255).astype("uint8")
    for name, pixels in {
        "a": noise,
        "b": (rng.random((120, 160, 3)) * 255).astype("uint8"),
        "c": (rng.random((120, 160, 3)) * 255).astype("uint8"),
        "a-near": np.clip(noise.astype(int) + 3, 0, 255).astype("uint8"),
        "tiny": (rng.random((20, 30, 3)) * 255).astype("uint8"),
    }.items():
        Image.fromarray(pixels).save(tmp_path / "images" / f"{name}.png")

    def rec(rid: str, *names: str) -> str:
        turns = [
            {"from": "human", "value": "<image>" * len(names) + f"\nQuestion {rid}?"},
            {"from": "gpt", "value": f"Answer {rid}."},
        ]
        return json.dumps({"id": rid, "image": [f"images/{n}.png" for n in names], "conversations": turns})

    records = [
        rec("first", "a"),
        rec("two", "b", "tiny"),
        rec("filler", "c"),
        rec("again", "a"),
        rec("both", "b", "a"),
        rec("near", "a-near"),
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(records) + "\n")
    (tmp_path / "more.jsonl").write_text(rec("elsewhere", "a") + "\n")  # another source: dedup spans the dataset
    recipe = {
        "dataset": "shared",
        "kind": "finetuning",
        "storage": str(tmp_path / "store"),
        "sources": [
            {"name": "chat", "manifest": str(tmp_path / "chat.jsonl"), "rows_per_shard": 2},
            {"name": "more", "manifest": str(tmp_path / "more.jsonl"), "rows_per_shard": 2},
        ],
        "download": {"network": {"file_root": str(tmp_path)}},
        "validate": {
            "license": {"allow": ["CC0-1.0"], "review": {"reviewed_by": "tests", "reviewed_on": "2026-12-01"}}
        },
        "finetune": {
            "conversation": {"image_root": str(tmp_path), "license": "CC0-1.0"},
            "padding": {"cutoff": "fixed", "max_tokens": 4096},
            "packing": {"packed": False},
        },
        "gates": {
            "download": {"min_success_rate": 0.0},
            # 6 of the 9 image rows are refused, 5 of them as duplicates: shared, they are not
            # refusals, and 1 of 4 is under the gate's 0.3
            "validate": {"max_reject_rate": 0.3},
            "finetune": {"max_reject_rate": 1.0, "min_fill_ratio": 0.0},
        },
    }
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    done = finetuning_flow(recipe_path=str(tmp_path / "recipe.yaml"), cluster=dask_address)
    base = tmp_path / "store" / "shared" / "releases" / done["release"].version
    ledger = {r["id"]: r for r in pq.read_table(base / "ledger.parquet").to_pylist()}
    fates = {rid: (r["status"], r["reason"]) for rid, r in ledger.items()}
    assert fates == {
        "first": ("ok", None),
        "two": ("rejected", "image_rejected"),  # its tiny image; its first image is kept for the others
        "filler": ("ok", None),
        "again": ("ok", None),
        "both": ("ok", None),
        "near": ("rejected", "image_rejected"),
        "elsewhere": ("ok", None),
    }
    assert "duplicate_of:" in ledger["near"]["detail"] and "image_too_small" in ledger["two"]["detail"]
    pixels = {}
    for tar in sorted(base.glob("**/*.tar")):
        for sample in _samples(tar):
            meta = json.loads(sample.members["json"])
            pixels[meta["id"]] = [
                np.asarray(Image.open(io.BytesIO(sample.members[m["member"]])).convert("RGB")) for m in meta["images"]
            ]
    assert set(pixels) == {"first", "filler", "again", "both", "elsewhere"}
    for rid, n in (("again", 0), ("both", 1), ("elsewhere", 0)):
        assert np.array_equal(pixels[rid][n], pixels["first"][0]), rid
    assert pixels["first"][0].shape == noise.shape  # released as validation wrote it


def test_a_curated_run_shares_a_kept_picture_and_holds_the_text_only_share(tmp_path, prefect_harness, dask_address):
    """With curation on, its ledger decides which images are kept while validation's pixel hash
    still ties an exact duplicate to the copy kept: both records that show the picture are
    released. The text-only share holds on what is released, after the pack caps dropped an
    image record; a turn of zero-width characters is empty."""
    import numpy as np
    from PIL import Image

    from flows.finetuning import finetuning_flow
    from tasks.demo.models import make_all

    clip = make_all(tmp_path / "models", ("clip",))["clip"]
    (tmp_path / "images").mkdir()
    rng = np.random.default_rng(5)
    for name in "abc":
        Image.fromarray((rng.random((200, 300, 3)) * 255).astype("uint8")).save(tmp_path / "images" / f"{name}.jpg")

    def rec(rid: str, *names: str, question: str = "Describe.") -> dict:
        turns = [
            {"from": "human", "value": "<image>" * len(names) + question},
            {"from": "gpt", "value": f"A noisy picture, {rid}."},
        ]
        return {"id": rid, "image": [f"images/{n}.jpg" for n in names], "license": "CC0-1.0", "conversations": turns}

    records = [rec("r0", "a"), rec("r1", "a"), rec("big", "b", "c")]  # big: over packing.max_images
    records += [rec(f"t{i}", question=f"Question {i}?") for i in range(4)]
    records.append(rec("zw", question="\u200b\u200b"))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = {
        "dataset": "curated-shared",
        "kind": "finetuning",
        "storage": str(tmp_path / "store"),
        "sources": [{"name": "chat", "manifest": str(tmp_path / "chat.jsonl")}],
        "download": {"network": {"file_root": str(tmp_path)}},
        "validate": {
            "license": {"allow": ["CC0-1.0"], "review": {"reviewed_by": "tests", "reviewed_on": "2026-12-01"}}
        },
        "curate": {"model": str(clip), "decode": "cpu", "alignment": {"min": -1.0}},
        "finetune": {
            "conversation": {"image_root": str(tmp_path)},
            "padding": {"cutoff": "fixed", "max_tokens": 4096},
            "packing": {"max_images": 1},
            "text_only_ratio": 0.5,
        },
        "gates": {
            "download": {"min_success_rate": 0.0},
            "validate": {"max_reject_rate": 0.9},
            "finetune": {"max_reject_rate": 0.9, "min_fill_ratio": 0.0},
        },
    }
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    done = finetuning_flow(recipe_path=str(tmp_path / "recipe.yaml"), cluster=dask_address)
    base = tmp_path / "store" / "curated-shared" / "releases" / done["release"].version
    fates = {r["id"]: (r["status"], r["reason"]) for r in pq.read_table(base / "ledger.parquet").to_pylist()}
    assert fates["r0"] == fates["r1"] == ("ok", None), fates
    assert fates["big"] == ("rejected", "too_many_images") and fates["zw"] == ("rejected", "conversation_empty_turn")
    text = [rid for rid in ("t0", "t1", "t2", "t3") if fates[rid] == ("ok", None)]
    released = [rid for rid, f in fates.items() if f[0] == "ok"]
    # 2 image records released: 2 text-only ones at 0.5, not the 3 the 3 accepted would allow
    assert len(text) == 2 and len(released) == 4, fates
    assert (
        sorted(f for rid, f in fates.items() if rid.startswith("t") and rid not in text)
        == [("rejected", "text_only_over_ratio")] * 2
    )


def test_an_exact_duplicate_of_a_copy_curation_removed_says_so():
    """The fates of an image are its last phase's row, with the pixel hash validation wrote (a
    curation ledger has none): a duplicate of a kept copy shares it; a record whose image is a
    duplicate of a copy curation removed is refused, and its detail names the copy and why."""
    from tasks.finetune.samples import _build_one, _image_fates, shared
    from tasks.formats.recipe_finetune import FinetuneConfig

    def ledger(*rows: tuple) -> pa.Table:  # as _fate_tables reads an image ledger
        names = ["key", "status", "reason", "detail", "shard", "pixel_sha256"]
        schema = pa.schema([pa.field(n, pa.string()) for n in names] + [pa.field("members", pa.null())])
        return pa.Table.from_pylist([dict(zip(names, r)) for r in rows], schema=schema)

    k = [f"chat-img-{i:09d}" for i in range(4)]
    validate = ledger(
        (k[0], "ok", None, None, "v.tar", "p"),
        (k[1], "rejected", f"duplicate_of:{k[0]}", None, None, "p"),
        (k[2], "ok", None, None, "v.tar", "q"),
        (k[3], "rejected", f"duplicate_of:{k[2]}", None, None, "q"),
    )
    curate = ledger(  # the images validation kept, without their pixel hash
        (k[0], "ok", None, None, "c.tar", None),
        (k[2], "rejected", "low_alignment", "alignment 0.1000 < 0.4", None, None),
    )
    fates = _image_fates([validate, curate], set(k))
    assert fates[k[0]]["shard"] == "c.tar" and fates[k[0]]["pixel_sha256"] == "p"
    assert shared(fates[k[1]], fates) is fates[k[0]]  # kept by curation: shared
    gone = shared(fates[k[3]], fates)
    assert gone["reason"] == f"duplicate_of:{k[2]}" and gone["status"] == "rejected"
    row: dict = {}
    rec = {"key": "chat-000000003", "source": "chat", "image_rows": [3]}
    assert _build_one(None, rec, fates, FinetuneConfig(), None, {}, row) is None
    assert row == {
        "reason": "image_rejected",
        "detail": f"image 0 ({k[3]}): duplicate_of:{k[2]} "
        f"(the same pixels as {k[2]}, which was not kept: low_alignment (alignment 0.1000 < 0.4))",
    }
