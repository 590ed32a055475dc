# syntax=docker/dockerfile:1
#
# Two images from one file:
#   docker build --target operator -t stalwart/operator:0.1.0 .   # the operator: stalwart without torch
#   docker build --target trainer  -t stalwart/trainer:0.1.0 .    # stalwart + CPU torch: the base for training images
# A training image starts FROM stalwart/trainer and adds the user's code (the trainer image runs the bundled
# example as is: `python -m stalwart.examples.train`); the operator runs the container's command under
# `stalwart agent -- ...`, so the image needs no entrypoint of its own.

# The base is pinned by digest: a rebuild gets the same bytes until the digest is changed on purpose.
ARG PYTHON_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

# ---- build: the stalwart wheel ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY stalwart ./stalwart
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

# ---- build: the operator's environment (no torch) --------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator-env
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /wheels
# The environment gets no pip of its own; the base image's pip installs into it.
RUN python -m venv --without-pip /opt/stalwart \
 && python -m pip --python /opt/stalwart/bin/python install --no-compile /wheels/*.whl

# ---- build: the trainer's environment (stalwart + CPU torch) ---------------------------------------------
FROM operator-env AS trainer-env
ARG TORCH_VERSION=2.13.0
# The CPU build: the default index would pull gigabytes of CUDA libraries.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python -m pip --python /opt/stalwart/bin/python install --no-compile \
        --index-url ${TORCH_INDEX_URL} --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}"

# ---- runtime base: a non-root user, nothing to build with ------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 stalwart \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/stalwart --create-home --shell /usr/sbin/nologin stalwart
ENV PATH=/opt/stalwart/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/stalwart

# ---- the operator image ----------------------------------------------------------------------------------
FROM runtime AS operator
COPY --from=operator-env /opt/stalwart /opt/stalwart
USER 10001:10001
ENTRYPOINT ["stalwart"]
CMD ["operator", "--all-namespaces"]

# ---- the trainer image -----------------------------------------------------------------------------------
FROM runtime AS trainer
COPY --from=trainer-env /opt/stalwart /opt/stalwart
USER 10001:10001
CMD ["stalwart", "--help"]
