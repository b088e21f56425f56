# The two commands of the quick start are `make run` and `make test`; each installs what is missing.
PY := .venv/bin/python

.PHONY: run test bootstrap protos bench deploy-generated

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	$(PY) -m splitserve up

test: bootstrap
	$(PY) -m pytest -q -ra --durations=15

protos: bootstrap
	$(PY) -m splitserve.protos.generate

bench: bootstrap
	$(PY) -m splitserve bench engine

# The chart's values.schema.json, the Grafana dashboards and the plain-Prometheus rules are generated (tests fail
# when a committed copy is stale).
deploy-generated: bootstrap
	$(PY) -m splitserve.deploy.chart_schema
	$(PY) -m splitserve.deploy.grafana
	$(PY) -m splitserve.deploy.prometheus
