# herald's image: the herald binary, the few glibc libraries it loads and the CA
# certificates, nothing else (no shell, no package manager).
#
#   docker build -t herald:0.1.0 .
#   docker run herald:0.1.0                       # cluster mode (`herald run`), in a pod
#   docker run -v "$PWD/config:/config:ro" -v herald-data:/var/lib/herald -p 8080:8080 \
#     herald:0.1.0 run --standalone --config /config  # standalone: no cluster
#
# Built on Debian 12 (glibc 2.36). scripts/image-rootfs lays out the final root filesystem
# from the binary: the binary, exactly the libraries `ldd` names (libc, libm, libgcc_s, the
# loader), the CA bundle, an nsswitch.conf (hosts: files dns; both are built into libc.so.6).
#
# Where no base image can be pulled (herald's own test machine), the final stage is built
# from a binary compiled on the machine instead: scripts/image lays the same root
# filesystem into target/image/rootfs with the same script and builds this file with
# `--build-arg ROOTFS=prebuilt`; the `build` stage is then never used, and nothing is pulled.
ARG ROOTFS=build

# ---- build -----------------------------------------------------------------------------
# Pinned by version; the image has gcc and libc6-dev (ring and SQLite are C).
FROM rust:1.95.0-slim-bookworm AS build
SHELL ["/bin/bash", "-eo", "pipefail", "-c"]
WORKDIR /src

# Dependencies first, in their own layer: it is rebuilt only when Cargo.toml or
# Cargo.lock change, not on every change of the sources. Stub targets stand in for the
# sources (the manifest names the benchmarks, whose files must exist for it to load).
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src benches \
 && echo 'fn main() {}' > src/main.rs \
 && : > src/lib.rs \
 && awk '/^\[\[bench\]\]/ { bench = 1; next } bench && /^name *=/ { gsub(/"/, "", $3); print $3; bench = 0 }' Cargo.toml \
    | while read -r name; do echo 'fn main() {}' > "benches/$name.rs"; done \
 && cargo build --release --locked --bin herald \
 && rm -rf src

COPY src ./src
COPY scripts/image-rootfs /usr/local/bin/image-rootfs
# Newer than the stubs' build, so cargo rebuilds herald itself (and only herald).
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked --bin herald \
 && image-rootfs target/release/herald /rootfs

# ---- or a root filesystem laid out by scripts/image from a binary built outside ------
FROM scratch AS prebuilt
COPY target/image/rootfs/ /rootfs/

# checkov:skip=CKV_DOCKER_7:this FROM names a stage of this file (build or prebuilt), not an image; the one image pulled, rust above, is pinned (hadolint and tests/chart check it)
FROM ${ROOTFS} AS rootfs

# ---- run -------------------------------------------------------------------------------
FROM scratch
LABEL org.opencontainers.image.title="herald" \
      org.opencontainers.image.description="Delivers signed webhooks from Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=rootfs /rootfs/ /
# The embedded store's default directory, owned by herald's user (COPY makes files root's).
COPY --from=rootfs --chown=65532:65532 /rootfs/var/lib/ /var/lib/
# Not root: the uid and gid the Helm chart runs as (runAsNonRoot needs a numeric user).
USER 65532:65532
ENV HERALD_LISTEN=0.0.0.0:8080 \
    HERALD_METRICS_LISTEN=0.0.0.0:9090 \
    HERALD_DATA_DIR=/var/lib/herald
# Ingest API; /healthz, /readyz and /metrics.
EXPOSE 8080 9090
# No VOLUME: on Kubernetes the runtime would quietly make an unnamed directory for it
# (containerd does), and a store there dies with the container. Mount the store's volume at
# /var/lib/herald (the chart mounts its PersistentVolumeClaim; `docker run -v`); without
# one, a read-only root filesystem makes herald stop at start with the reason.
ENTRYPOINT ["/usr/local/bin/herald"]
# The operator (cluster mode). Standalone is one flag away: `run --standalone --config DIR`.
CMD ["run"]
