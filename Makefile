# The two commands of the quick start are `make run` and `make test`; each installs what is missing.
PY := .venv/bin/python

.PHONY: run test bootstrap protos bench

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	$(PY) -m splitserve up

test: bootstrap
	$(PY) -m pytest -q -ra

protos: bootstrap
	$(PY) -m protos.generate

bench: bootstrap
	$(PY) -m splitserve bench engine
