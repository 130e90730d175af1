# Every target creates or reuses .venv in the repo root and installs what it needs there.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.demo-stamp

# The Lightning-facing tests also run against the oldest Lightning pyproject.toml allows, in a
# venv holding only that Lightning; everything else comes from .venv (a .pth file appends its
# site-packages after this venv's own, so the old Lightning wins).
OLDEST := .venv-lightning-oldest
LIGHTNING_MIN := $(shell sed -n 's/^ *"lightning>=\([0-9.]*\)".*/\1/p' pyproject.toml)
LIGHTNING_TESTS := tests/test_lightning_compat.py tests/test_callback.py tests/test_checkpoint_io.py

# transformers 4.x, for the test that it loads what save_pretrained writes: installed alone into
# its own folder (no dependencies: the rest comes from .venv); the test puts it first on the path.
TRANSFORMERS4 := .venv-transformers4
TRANSFORMERS4_PINS := transformers==4.57.1 huggingface_hub==0.36.0 tokenizers==0.22.1

# The test libraries only the pytest process imports (requirements-slow-imports.txt: transformers
# 5, MLflow), with what .venv lacks of their dependencies (scipy, matplotlib, pandas, ...), go
# to a folder beside .venv that tests/conftest.py adds to the pytest process's path alone (one
# resolution for both files: tools/install_split.py). Lightning imports torchmetrics, which
# imports scipy, matplotlib and transformers whenever it can: ~4 s of the ~10 s each training
# subprocess of the tests took to start here.
SLOW_IMPORTS := .venv-slow-imports

.PHONY: test test-lightning-oldest transformers4 demo bench docs lint format clean

# `make demo` installs the package (its example needs nothing more); `make test` adds the
# development stack of requirements-dev.txt (test runner, linters, docs, the servers the tests
# start) and, beside it, requirements-slow-imports.txt.
$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e .
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP) requirements-dev.txt requirements-slow-imports.txt tools/install_split.py
	rm -rf $(SLOW_IMPORTS)
	$(PY) tools/install_split.py requirements-dev.txt requirements-slow-imports.txt $(SLOW_IMPORTS) \
		constraints.txt
	# litdata's StreamingDataLoader, for the Fabric loader tests. Without its dependencies: it
	# declares torchvision, whose PyPI wheel is built against CUDA torch and, beside the CPU
	# pin, breaks `import lightning`; what litdata's loader needs is already installed.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -c constraints.txt 'litdata>=0.2.50'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# the package's optional transformers calls are checked against the one the tests use
	PYTHONPATH=$(SLOW_IMPORTS) $(VENV)/bin/mypy

# One pytest worker per core, each running whole test files (tests/conftest.py orders them,
# slowest first); TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

test: lint transformers4
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
	$(MAKE) test-lightning-oldest

$(OLDEST)/.stamp-$(LIGHTNING_MIN): $(STAMP)
	rm -rf $(OLDEST)
	$(PYTHON) -m venv $(OLDEST)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(OLDEST)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_lightning_bpk_venv.pth"
	$(OLDEST)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps 'lightning==$(LIGHTNING_MIN)'
	touch $@

$(TRANSFORMERS4)/.stamp: $(STAMP)
	rm -rf $(TRANSFORMERS4)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --target $(TRANSFORMERS4) \
		$(TRANSFORMERS4_PINS)
	touch $@

transformers4: $(TRANSFORMERS4)/.stamp

test-lightning-oldest: $(OLDEST)/.stamp-$(LIGHTNING_MIN)
	$(OLDEST)/bin/python -c 'import lightning; assert lightning.__version__ == "$(LIGHTNING_MIN)", lightning.__version__'
	$(OLDEST)/bin/python -m pytest -q -p no:cacheprovider $(LIGHTNING_TESTS)

demo: $(DEMO_STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/run.py
	PYTHONPATH=$(SLOW_IMPORTS) $(PY) benchmarks/remap_load.py
	PYTHONPATH=$(SLOW_IMPORTS) $(PY) benchmarks/hub_load.py

# The site also builds (strictly) inside `make test`, via tests/test_docs.py.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(OLDEST) $(TRANSFORMERS4) $(SLOW_IMPORTS) .pytest_cache .ruff_cache .mypy_cache .hypothesis site
