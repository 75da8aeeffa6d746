# The two commands of the README: `make demo` and `make test`. Both install what they need first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check chaos acceptance install kafka browser podman nginx prometheus up down bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

kafka: $(STAMP)
	$(BIN)/gpupool kafka fetch

demo: kafka nginx
	$(BIN)/gpupool demo

# The dashboard's tests drive Debian's chromium headless (tests/browser.py). Installed here when missing: with
# apt-get as root; otherwise this says what to install and the browser tests fail saying the same.
browser:
	@if command -v chromium >/dev/null 2>&1 || [ -n "$$GPUPOOL_CHROMIUM" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's chromium for the dashboard's browser tests (apt-get)"; \
	  (apt-get install -y -qq chromium fonts-dejavu-core >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq chromium fonts-dejavu-core >/dev/null)) || \
	  echo "WARNING: apt-get could not install chromium; the browser tests will fail (set GPUPOOL_CHROMIUM)"; \
	else echo "WARNING: no chromium and no apt-get as root: install Debian's chromium (or set GPUPOOL_CHROMIUM to a"; \
	  echo "         Chromium/Chrome binary); the dashboard's browser tests fail without one"; fi

# Jobs that name an image run in podman containers (docs/operators.md, "Preparing a node"); the tests build a small
# image from Debian's busybox. Installed here when missing: with apt-get as root; otherwise this says what to install
# and the container tests fail saying the same (tests/program_helpers.py).
podman:
	@pkgs=""; command -v podman >/dev/null 2>&1 || pkgs="$$pkgs podman"; \
	command -v runc >/dev/null 2>&1 || pkgs="$$pkgs runc"; \
	[ -x /usr/libexec/podman/catatonit ] || command -v catatonit >/dev/null 2>&1 || pkgs="$$pkgs catatonit"; \
	command -v busybox >/dev/null 2>&1 || pkgs="$$pkgs busybox-static"; \
	if [ -z "$$pkgs" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing$$pkgs for jobs that name an image (apt-get)"; \
	  (apt-get install -y -qq $$pkgs >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq $$pkgs >/dev/null)) || \
	  echo "WARNING: apt-get could not install$$pkgs; the container tests will fail"; \
	else echo "WARNING: missing$$pkgs and no apt-get as root: install Debian's podman, runc, catatonit and"; \
	  echo "         busybox-static; jobs naming an image fail on this node, and the container tests fail"; fi

# The serving router (agents/router.py, docs/serving.md) drives Debian's nginx, each instance with its own prefix,
# config and port; the serving tests and the demo's peak start one. Installed here when missing: with apt-get as
# root; otherwise this says what to install and the router tests fail saying the same.
nginx:
	@if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || [ -n "$$GPUPOOL_NGINX" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's nginx for the serving router (apt-get)"; \
	  (apt-get install -y -qq nginx-light >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null)) || \
	  echo "WARNING: apt-get could not install nginx; the router tests will fail (set GPUPOOL_NGINX)"; \
	else echo "WARNING: no nginx and no apt-get as root: install Debian's nginx-light (or set GPUPOOL_NGINX to an"; \
	  echo "         nginx binary); the serving router's tests fail without one"; fi

# The alerting rules (infra/prometheus/) are unit-tested with promtool, and a live test has Debian's prometheus
# scrape the worker and a node agent (tests/test_prometheus_live.py). Installed here when missing: with apt-get as
# root; otherwise this says what to install and those tests fail saying the same.
prometheus:
	@if { command -v prometheus && command -v promtool; } >/dev/null 2>&1 || \
	  { [ -n "$$GPUPOOL_PROMETHEUS" ] && [ -n "$$GPUPOOL_PROMTOOL" ]; }; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's prometheus for the alerting rules' and the scrape's tests (apt-get)"; \
	  (apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null)) || \
	  echo "WARNING: apt-get could not install prometheus; the Prometheus tests will fail (set GPUPOOL_PROMETHEUS)"; \
	else echo "WARNING: no prometheus/promtool and no apt-get as root: install Debian's prometheus (or set"; \
	  echo "         GPUPOOL_PROMETHEUS and GPUPOOL_PROMTOOL); the Prometheus tests fail without them"; fi

test: kafka browser podman nginx prometheus
	$(BIN)/python -m pytest -q -p no:cacheprovider --ignore=tests/acceptance --ignore=tests/test_demo.py -m "not chaos" tests

# the fast target: unit, property and scenario tests, no broker and no browser (tests/conftest.py fails a test that
# starts either without the `broker` mark); its property tests draw a quarter of their examples (tests/conftest.py).
# `make test` stays the whole suite, every example; .ci/run calls that.
check: $(STAMP) podman prometheus nginx
	GPUPOOL_CHECK=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n auto --ignore=tests/acceptance --ignore=tests/test_demo.py -m "not chaos and not broker" tests

# the fault tests of docs/reliability.md: a local 3-broker KRaft cluster, two workers, kill -9, a broker down,
# ClickHouse away for 60 s, the whole stack stopped and started (heavy: three JVMs; about ten minutes here)
chaos: kafka
	$(BIN)/python -m pytest -q -p no:cacheprovider -m chaos tests/test_cluster_live.py tests/test_up_cluster.py

# seed 004's four acceptance groups against a live stack of their own; the report a buyer reads lands in docs/acceptance
acceptance: kafka
	$(BIN)/gpupool acceptance report --out docs/acceptance

up: kafka
	$(BIN)/gpupool up

down: $(STAMP)
	$(BIN)/gpupool down

clean:
	rm -rf $(VENV) .gpupool
