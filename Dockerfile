# One image for the web app and the GPU worker: PyTorch with CUDA, plus profiler_svc.
#   docker compose up            (see docker-compose.yml)
# The web app never imports torch; the worker runs A/B tests on the GPU it is given.
ARG BASE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PROFILER_SVC_HOME=/data PROFILER_SVC_BLOB_DIR=/data/blobs
WORKDIR /app
COPY pyproject.toml README.md ./
COPY profiler_svc ./profiler_svc
COPY kernels ./kernels
COPY web ./web
COPY migrations ./migrations
RUN pip install '.[postgres]' && useradd --create-home --uid 1000 profiler && mkdir -p /data \
    && chown profiler /data
USER profiler
EXPOSE 8000
CMD ["profiler_svc", "serve", "--host", "0.0.0.0", "--port", "8000", "--threads", "8"]
