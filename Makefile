# The two commands: `make demo` and `make test`. Both set up .venv first (idempotent).
PYTHON ?= python3.11
VENV   := .venv
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: setup demo examples docs test gpu-check lint system-deps bench-download energon-venv clean
ENERGON := .bench/energon-venv

# uv installs what pip would, a few times faster (tools/install.py hands it pip's configuration);
# pip does it when uv cannot.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip uv
	$(VENV)/bin/python tools/install.py -e '.[test]' || $(VENV)/bin/pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

# The project's own modules are compiled here, as pip compiles what it installs: an editable
# install leaves that to the first import, which skips writing the bytecode wherever
# PYTHONDONTWRITEBYTECODE is set (containers, CI images), so every CLI, Dask worker and test
# process would compile the sources again. Quick when nothing changed.
setup: $(STAMP)
	$(VENV)/bin/python -m compileall -q -j 0 cli flows tasks loaders deployments > /dev/null

# Both datasets: the pretraining demo (corpus, loopback server, release with latents), the video
# demo (short videos cut into clips, their own release), then the fine-tuning demo over the same
# images (conversations, tiles, packs, its own release).
demo: setup
	$(VENV)/bin/shardsmith demo
	$(VENV)/bin/shardsmith demo --video
	$(VENV)/bin/python -m tasks.demo.finetune shardsmith-demo > /dev/null
	SHARDSMITH_DEMO_DIR=$(CURDIR)/shardsmith-demo $(VENV)/bin/shardsmith run recipes/demo-finetune.yaml

# The example recipes (recipes/example-*.yaml: img2dataset's output, a Hugging Face parquet
# export) on inputs made from the demo's pictures, each to a release.
examples: setup
	$(VENV)/bin/shardsmith demo --examples

# The documentation site (MkDocs Material) into site/, warnings as errors: every internal link
# resolves; the recipe, reasons and CLI references are generated from the code (docs/hooks/).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Lint, format and type checks (configured in pyproject.toml); .ci/run runs them before the tests.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: setup $(ENERGON)/.installed
	$(VENV)/bin/python -m pytest -n auto --dist loadfile --no-loadscope-reorder --durations=25

# On a machine with a GPU: every gpu-marked test and the GPU modes of the precache, curation,
# clip-decode and face-detection benchmarks, in under ten minutes, all into .bench/gpu-check/results.md
# (tools/gpu_check.py). Without a GPU it says so in one line and succeeds.
gpu-check: setup
	$(VENV)/bin/python tools/gpu_check.py

# Debian packages the browser check (headless Chromium driven by chromedriver) and the
# PostgreSQL check of tests/test_deployments.py need. .ci/run installs them (CI runs as root
# on a fresh Debian machine, where these checks must run, not skip); on a workstation run
# `sudo make system-deps` once. Installs only what is missing, quietly; never a downloaded browser.
SYSTEM_PACKAGES := chromium:chromium chromedriver:chromium-driver initdb:postgresql
system-deps:
	@missing=""; \
	for pair in $(SYSTEM_PACKAGES); do \
	  cmd=$${pair%%:*}; pkg=$${pair#*:}; \
	  if [ "$$cmd" = initdb ]; then ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && continue; \
	  else command -v $$cmd >/dev/null 2>&1 && continue; fi; \
	  missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# Megatron-Energon and wids read releases in tests; they live in a venv of their own (energon
# pins tzdata<2026) that sees the project's packages through a .pth file. Optional for a
# developer: if this fails, those reader tests skip and the byte-level format checks still run.
# Required in CI (CI=true): a failure here fails the run, and the reader tests refuse to skip.
$(ENERGON)/.installed: $(STAMP)
	( $(PYTHON) -m venv $(ENERGON) \
	  && $(VENV)/bin/python -c "import site; print(site.getsitepackages()[0])" > $$($(ENERGON)/bin/python -c "import site; print(site.getsitepackages()[0])")/shardsmith-project.pth \
	  && $(ENERGON)/bin/pip install --quiet megatron-energon==7.4.1 wids \
	  && touch $@ ) \
	|| if [ "$$CI" = "true" ]; then echo "energon-venv: install failed; CI needs energon and wids for the release reader tests" >&2; exit 1; \
	   else echo "energon-venv: install failed; the energon and wids reader tests will skip" >&2; fi

energon-venv: $(ENERGON)/.installed

bench-download: setup
	$(VENV)/bin/python bench/bench_web.py --download --reencode --prefect server

clean:
	rm -rf $(VENV) shardsmith-demo .bench site
