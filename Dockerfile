# herald's image: one static binary and the CA certificates, nothing else.
#
#   docker build -t herald:0.1.0 .
#   docker run herald:0.1.0                       # cluster mode (`herald run`), in a pod
#   docker run -v "$PWD/config:/config:ro" -v herald-data:/var/lib/herald -p 8080:8080 \
#     herald:0.1.0 run --standalone --config /config  # standalone: no cluster
#
# Built on Alpine, so the binary links musl statically and runs on `scratch`.

# ---- build -----------------------------------------------------------------------------
# Pinned by version; the image has gcc and musl-dev (ring and SQLite are C).
FROM rust:1.95.0-alpine3.23 AS build
SHELL ["/bin/ash", "-eo", "pipefail", "-c"]
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
# Newer than the stubs' build, so cargo rebuilds herald itself (and only herald).
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked --bin herald \
 && mkdir -p /rootfs/var/lib/herald /rootfs/tmp \
 && chown 65532:65532 /rootfs/var/lib/herald \
 && chmod 1777 /rootfs/tmp

# ---- run -------------------------------------------------------------------------------
FROM scratch
LABEL org.opencontainers.image.title="herald" \
      org.opencontainers.image.description="Delivers signed webhooks from Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /rootfs/ /
COPY --from=build /src/target/release/herald /usr/local/bin/herald
# Not root: the uid and gid the Helm chart runs as (runAsNonRoot needs a numeric user).
USER 65532:65532
ENV HERALD_LISTEN=0.0.0.0:8080 \
    HERALD_METRICS_LISTEN=0.0.0.0:9090 \
    HERALD_DATA_DIR=/var/lib/herald
# Ingest API; /healthz, /readyz and /metrics.
EXPOSE 8080 9090
VOLUME ["/var/lib/herald"]
ENTRYPOINT ["/usr/local/bin/herald"]
# The operator (cluster mode). Standalone is one flag away: `run --standalone --config DIR`.
CMD ["run"]
