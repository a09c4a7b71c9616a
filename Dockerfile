# herald: one static-ish binary on a small base image.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
# Cargo.toml names the benchmark target; its file must exist for the manifest to load.
COPY benches ./benches
RUN cargo build --release --locked --bin herald

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/herald /usr/local/bin/herald
USER nonroot
# Standalone until the operator mode exists: mount manifests at /config and a writable
# volume at /data (the embedded store).
VOLUME ["/data"]
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/herald"]
CMD ["run", "--standalone", "--config", "/config", "--data-dir", "/data", "--listen", "0.0.0.0:8080"]
