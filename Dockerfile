# syntax=docker/dockerfile:1.7
#
# One image for every Tandem process: `tandem serve {dispatcher,verifier,drafter,prefix,suffix}`,
# `tandem models prepare` (the one-shot job that fills the models volume) and `tandem link` (the
# WAN emulator).  See docs/deploy.md.
#
#   docker build -t tandem:latest .                                  # CPU (default)
#   docker build -t tandem:cuda --build-arg VARIANT=cuda .           # torch with CUDA (cloud half)
#
# Build arguments:
#   VARIANT          cpu | cuda. cpu installs torch from the PyTorch CPU index; cuda installs the
#                    default PyPI torch wheel, which is the CUDA build and brings its own CUDA
#                    runtime libraries (the host needs only the NVIDIA driver + container toolkit).
#   TORCH_VERSION    torch version (default 2.13.0).
#   TORCH_INDEX_URL  overrides the index torch comes from, e.g.
#                    https://download.pytorch.org/whl/cu126 for an older driver.
#   PYTHON_IMAGE     base image of both stages (default python:3.11-slim-bookworm).
#   BUILDER_IMAGE, RUNTIME_IMAGE   set the two stages apart, e.g. a CUDA *devel* image with
#                    Python 3.11 for a CUDA llama.cpp build; python must live at the same path in
#                    both, because the virtual environment is copied from one to the other.
#   LLAMA_CPP_VERSION            llama-cpp-python version (compiled from source).
#   LLAMA_CMAKE_ARGS             core library only; GGML_NATIVE=OFF keeps the image portable
#                                (AVX2/FMA/F16C on x86-64, no -march=native of the build host).
#   LLAMA_CMAKE_EXTRA            appended, e.g. "-DGGML_CUDA=on" for a GPU drafter (needs nvcc in
#                                BUILDER_IMAGE and CUDA libraries in RUNTIME_IMAGE).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG BUILDER_IMAGE=${PYTHON_IMAGE}
ARG RUNTIME_IMAGE=${PYTHON_IMAGE}

# ---------------------------------------------------------------------------------------------
FROM ${BUILDER_IMAGE} AS builder

ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ARG LLAMA_CPP_VERSION=0.3.36
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
ARG LLAMA_CMAKE_EXTRA=

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/app/.venv \
    PATH=/app/.venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && rm -rf /var/lib/apt/lists/*

RUN --mount=type=cache,target=/root/.cache/pip \
    python -m venv /app/.venv \
 && pip install --upgrade pip wheel setuptools

# torch first, from the index the variant calls for (the PyTorch index mirrors torch's own
# dependencies); `pip install .` below finds it installed and keeps it.
RUN --mount=type=cache,target=/root/.cache/pip \
    set -eu; \
    case "$VARIANT" in \
      cpu)  index="https://download.pytorch.org/whl/cpu" ;; \
      cuda) index="https://pypi.org/simple" ;; \
      *)    echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip install --index-url "${TORCH_INDEX_URL:-$index}" "torch==${TORCH_VERSION}"

# llama-cpp-python compiles llama.cpp from source (minutes); the pip cache mount keeps the wheel.
RUN --mount=type=cache,target=/root/.cache/pip \
    CMAKE_ARGS="${LLAMA_CMAKE_ARGS} ${LLAMA_CMAKE_EXTRA}" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip install "llama-cpp-python==${LLAMA_CPP_VERSION}"

# Tandem itself (non-editable) with its remaining dependencies.
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install . \
 && (python -P -m common.cpu_kernels || echo "the runner will use oneDNN's products") \
 && python -c "import torch, llama_cpp, zmq, common.metrics, tandem; print('torch', torch.__version__, 'cuda' if torch.version.cuda else 'cpu')" \
 && tandem --help > /dev/null

# ---------------------------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE} AS runtime

LABEL org.opencontainers.image.title="tandem" \
      org.opencontainers.image.description="One LLM served across edge and cloud: speculative (PipeSD) and split (DySCo) modes" \
      org.opencontainers.image.licenses="Apache-2.0"

# libgomp1: OpenMP runtime of the llama.cpp build (torch wheels bundle their own).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 libstdc++6 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid tandem --home-dir /home/tandem --create-home tandem \
 && mkdir -p /models \
 && chown tandem:tandem /models

COPY --from=builder /app/.venv /app/.venv

# A fresh named volume mounted on /models inherits the directory's owner, so the non-root user
# can write it.  Services listen on all interfaces inside the container; HTTP and ZMQ ports are
# published (or not) by compose.  Everything is local: no hub downloads at run time.
ENV VIRTUAL_ENV=/app/.venv \
    PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TANDEM_MODELS_DIR=/models \
    TANDEM_HTTP_HOST=0.0.0.0 \
    HF_HOME=/home/tandem/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    GOMP_SPINCOUNT=20000

# Threads and cores: `tandem serve` plans them at start from what the container may use (its
# cpuset, its CPU quota; docs/deploy.md "Threads and cores"): a model service takes as many
# threads as its half has cores, the dispatcher and a GPU service one.  The services of a half
# share cores, so an idle OpenMP thread spins ~0.2 ms, not ~3 ms, before it sleeps (GOMP_SPINCOUNT
# above): a service whose turn is over gives the cores back at once.

USER 10001:10001
WORKDIR /home/tandem

# ZMQ (dispatcher 5550, verifier 5551, drafter 5552, prefix 5553, suffix 5554) and HTTP
# (/metrics, /healthz, /readyz on 9550-9554).
EXPOSE 5550-5554 9550-9554

# Health is checked per service by compose (GET /readyz on the service's TANDEM_HTTP_PORT).
ENTRYPOINT ["tandem"]
CMD ["--help"]
