# The two set-up commands: `make demo` runs the main job, `make test` passes the tests.
PYTHON ?= python3
# Where the virtual environment lives; CI points it at a cache outside the clone (.ci/run).
VENV ?= .venv
BIN := $(VENV)/bin
# Test processes (xdist): one more than the cores, since most tests that start real processes
# spend their time waiting on them; each test module runs whole on one test process, so its
# module-scoped servers, agents and trained models are built once (tests/README.md).
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
# The tests' temporary files on tmpfs where there is one with 6 GiB free (SQLite commits and
# checkpoints without disk syncs); one folder per checkout, emptied at each run and removed
# after a run that passed. A passing test's own folder goes as it ends (pyproject.toml).
TEST_TMP ?= $(shell if [ -d /dev/shm ] && [ -w /dev/shm ] \
	&& [ "$$(df -Pk /dev/shm | awk 'NR==2 {print $$4}')" -ge 6291456 ]; then \
	echo /dev/shm/torchyard-tests-$$(id -u)-$$(printf %s "$(CURDIR)" | cksum | cut -d' ' -f1); fi)

# The modules that mark tests `serial` (tests/README.md): the serial part collects only them,
# not the whole suite again (about 10 s).
SERIAL_MODULES := $(shell grep -rl --include='test_*.py' 'pytest.mark.serial' tests)

.PHONY: demo test lint

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/torchyard demo

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	@start=$$(date +%s); \
	$(if $(TEST_TMP),mkdir -p "$(TEST_TMP)";) \
	$(BIN)/python -m pytest -q -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "not serial" $(if $(TEST_TMP),--basetemp=$(TEST_TMP)/parallel); rc=$$?; \
	echo "parallel part: $$(( $$(date +%s) - start )) s"; \
	$(BIN)/python -m pytest -q -ra --durations=10 -p no:xdist -m serial $(SERIAL_MODULES) \
		$(if $(TEST_TMP),--basetemp=$(TEST_TMP)/serial); rc2=$$?; \
	echo "test suite wall time: $$(( $$(date +%s) - start )) s"; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; \
	if [ $$rc2 -eq 5 ]; then rc2=0; fi; \
	if [ $$rc -eq 0 ] && [ $$rc2 -eq 0 ] && [ -n "$(TEST_TMP)" ]; then rm -rf "$(TEST_TMP)"; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $$rc2
