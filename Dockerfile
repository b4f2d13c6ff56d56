# Image for the operator, the admin API and the reference trainer's worker pods.
# TORCH selects the PyTorch build: the default takes torch==2.13.0 from pip's index (on Linux,
# plain PyPI serves the CUDA build). Name the index for the build you want, e.g.
#   docker build --build-arg TORCH="torch==2.13.0 --index-url <PyTorch's CPU or CUDA wheel index>" -t elastic:0.1.0 .
FROM python:3.11-slim
ARG TORCH="torch==2.13.0"
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
# torch first, so the project's requirements never pull a different build
RUN pip install ${TORCH}
COPY pyproject.toml README.md ./
COPY elastic ./elastic
COPY operators ./operators
RUN pip install .
USER 65532:65532
ENTRYPOINT ["elastic"]
CMD ["operator"]
