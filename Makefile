# The two set-up commands of the README: `make demo` and `make test`. Both install what is missing.
# Into .venv/ in this checkout, made by make from $(BASE_PY) with the machine's own packages visible (a torch
# already there, a GPU machine's say, is used, not replaced; what is missing goes into .venv): nothing outside
# the checkout changes, so a second clone's `make` never re-points another clone's meshscope. Only the Debian
# servers (install-servers) are machine-wide. PY=... runs everything with another Python instead.
BASE_PY ?= python3
VENV ?= .venv
PY ?= $(VENV)/bin/python
PIP = $(PY) -m pip
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The tracer's C++ kernels are built (and found at run time) here, not in ~/.cache, for what make runs.
export MESHSCOPE_CACHE_DIR ?= $(abspath $(VENV))/cache

.PHONY: demo test install install-servers test-fast bench gpu-check clean

# torchrun as pip would write it: a machine's torch brings its console script outside .venv, where it would
# start the machine's Python, which may not have meshscope (`meshscope run -- torchrun ...` after activate).
$(VENV)/bin/python:
	$(BASE_PY) -m venv --system-site-packages $(VENV)
	@printf '#!%s\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n' "$(abspath $(VENV))/bin/python" > $(VENV)/bin/torchrun
	@chmod +x $(VENV)/bin/torchrun

# torch first, from the pinned CPU wheel (a GPU machine keeps the torch it has): pyproject only declares
# a range, so pip never resolves a newer torch with gigabytes of CUDA packages. Then meshscope itself,
# editable from this checkout (a clone elsewhere on the same machine must not test another checkout's
# code), then whatever of the rest is missing.
# The C form of the tracer's hot path (agent/instrument/_hot.c) is built by the editable install next to its
# sources; rebuilt when one is newer than this interpreter's build (no C compiler: the Python path). The
# functional collectives' kernels (a torch C++ extension: agent/instrument/funcol_kernels.py) are built last,
# against the torch installed, into MESHSCOPE_CACHE_DIR (~40 s once per torch and source; none: the sites).
# torchtitan 0.3.0 (tests/realworld: the real third-party trainer under meshscope run) and its torch-dependent
# packages without their dependencies (they would pull another torch; torchtitan's wandb is imported only when
# enabled); its other dependencies are in the test extra.
NATIVE_CURRENT = $(PY) -c "import glob, os, sys, sysconfig; so = 'agent/instrument/_hot' + sysconfig.get_config_var('EXT_SUFFIX'); sys.exit(not (os.path.exists(so) and all(os.path.getmtime(so) >= os.path.getmtime(f) for f in glob.glob('agent/instrument/_hot*.[ch]'))))"

install: $(filter $(VENV)/bin/python,$(PY))
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	@$(PY) -c "import os, meshscope.agent; assert os.path.realpath(meshscope.agent.__file__).startswith(os.path.realpath('agent') + os.sep)" 2>/dev/null \
		|| $(PIP) install -q --no-deps -e .
	@$(NATIVE_CURRENT) || ! command -v cc >/dev/null || $(PIP) install -q --no-deps --no-build-isolation -e .
	@$(PY) -c "import meshscope.agent, meshscope.dashboard, streamlit, duckdb, pyarrow, prometheus_client, pytest_timeout, xdist, filelock, hypothesis, playwright, yaml, cryptography, psutil, plotly, pynvml, tqdm, ninja, setuptools.command.bdist_wheel, transformers, accelerate, lightning, moto.server, opentelemetry.sdk, opentelemetry.exporter.otlp.proto.http" 2>/dev/null \
		|| $(PIP) install -e '.[test]'
	@$(PY) -c "import torchtitan, torchdata, torch_checkpointing, spmd_types, datasets, tokenizers, safetensors, tyro, tensorboard, einops, triton" 2>/dev/null \
		|| { $(PIP) install -q --no-deps torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 spmd_types==0.2.3 \
			&& $(PIP) install -e '.[test]'; }
	@# HTA (tests/test_deeptrace.py reads `meshscope trace`'s traces with it) without its jupyterlab, which it
	@# never imports: its other dependencies are in the test extra
	@$(PY) -c "import hta, networkx, pydot" 2>/dev/null \
		|| { $(PIP) install -q --no-deps HolisticTraceAnalysis==0.5.0 && $(PIP) install -e '.[test]'; }
	@$(PY) -m meshscope.agent.instrument.funcol_kernels --check >/dev/null 2>&1 || ! command -v c++ >/dev/null \
		|| $(PY) -m meshscope.agent.instrument.funcol_kernels

# Real servers and a real browser for the integration tiers (Debian packages).
install-servers:
	@if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null || ! command -v chromium >/dev/null \
			|| ! command -v victoria-metrics >/dev/null || ! command -v vmalert >/dev/null; then \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq prometheus prometheus-alertmanager chromium victoria-metrics >/dev/null; \
	fi

demo: install install-servers
	$(PY) -m meshscope demo

# Every test's duration goes to artifacts/junit.xml (bench/suite_durations.py reads it). On one worker by
# default: gloo ranks spin while they wait, so on 2 cores two pytest-xdist workers' jobs burn each other's CPU
# (measured: 45.5 min and 77.6 CPU-min against 40.3 and 46.6 on one; bench/results/suite-2026-11-29-1945-xdist2.txt).
# On a machine with cores to spare, TEST_WORKERS=N runs the suite on N workers, a test file per worker at a
# time (a file's module fixtures are its own jobs), then the tests marked `serial` (a time or CPU cost held to
# a fixed bound, one phase of a run against another) alone (artifacts/junit-serial.xml). Both phases read the
# same reference runs, made once (artifacts/reference, emptied first).
TEST_WORKERS ?= 1
test: install install-servers
	@rm -rf artifacts/reference
	@export TESTS_REFERENCE_DIR=$(abspath artifacts/reference); rm -f artifacts/junit-serial.xml; \
	if [ "$(TEST_WORKERS)" -le 1 ]; then $(PY) -m pytest tests --junitxml=artifacts/junit.xml; else rc=0; \
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile -m "not serial" --junitxml=artifacts/junit.xml || rc=$$?; \
	$(PY) -m pytest tests -m serial --junitxml=artifacts/junit-serial.xml || rc=$$?; exit $$rc; fi

test-fast: install
	$(PY) -m pytest tests -m "not gloo and not server and not browser and not packaging"

bench: install
	$(PY) bench/telemetry_overhead.py
	$(PY) bench/agent_ingest.py
	$(PY) bench/hooks_overhead.py
	$(PY) bench/profiler_agreement.py
	$(PY) bench/dashboard_pages.py
	$(PY) bench/spool_outage.py
	$(PY) bench/zerocode_overhead.py

# On a machine with an NVIDIA GPU (and the torch it has: torch is added only where none imports): the
# trainer's 1b MFU, collective timing vs the profiler, the allocator and NVML fields, the telemetry overhead;
# a Markdown report in gpu-check.md. Prints one line and does nothing without a GPU. Installs only what the
# kit imports (a GPU machine may have no route to PyPI): meshscope without dependencies, then the kit's own
# imports where missing; GPU_CHECK_PIP passes pip options, e.g. "--no-index --find-links WHEELS" offline,
# GPU_CHECK_ARGS the kit's own (--timeout-s, --steps, --out).
GPU_CHECK_PIP ?=
GPU_CHECK_ARGS ?=
gpu-check: $(filter $(VENV)/bin/python,$(PY))
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	@$(PY) -c "import os, meshscope.agent; assert os.path.realpath(meshscope.agent.__file__).startswith(os.path.realpath('agent') + os.sep)" 2>/dev/null \
		|| $(PIP) install -q --no-deps --no-build-isolation -e .
	@$(PY) -c "import duckdb, pandas, pyarrow, pynvml, tqdm" 2>/dev/null \
		|| $(PIP) install -q $(GPU_CHECK_PIP) duckdb pandas pyarrow nvidia-ml-py tqdm
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf .runs artifacts .pytest_cache
