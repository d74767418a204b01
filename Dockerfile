# mesh: one image for every role (broker, indexer, gateway, adapter sidecar, simulated workers).
#   docker build -t mesh .
#   docker run --rm mesh --help
# The compose file (deploy/compose.yaml) and the Kubernetes manifests (deploy/k8s/) use it.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/mesh
COPY pyproject.toml README.md ./
COPY mesh ./mesh
COPY brokers ./brokers
COPY workers_stub ./workers_stub
COPY configs ./configs
RUN pip install '.[valkey]' && useradd --system --uid 10001 --no-create-home mesh
USER 10001
# ZeroMQ client / worker ports, HTTP ingress, Prometheus, peer exchange; indexer gRPC and metrics
EXPOSE 5555 5556 8000 9100 5570 50051 9101
ENTRYPOINT ["mesh"]
CMD ["--help"]
