# syntax=docker/dockerfile:1
#
# gpumem-exporter container image. Built and run in CI (tests/e2e/image.rs,
# through scripts/ci/build-image: the runtime stage below as written, the
# base assembled from Debian's packages, the build stage stood in for by
# the same cargo command on the host); see docs/deploying.md, "Container
# image".
#
#     docker build -t registry.example.com/gpumem-exporter:0.1.0 \
#         --build-arg GPUMEM_EXPORTER_REVISION=$(git rev-parse --short=12 HEAD) .
#
# The image holds no NVIDIA library: NVML (libnvidia-ml.so.1) is dlopened at
# run time and injected by the NVIDIA container runtime
# (NVIDIA_DRIVER_CAPABILITIES=utility), so the binary is built against glibc
# (a static musl binary could not dlopen the driver's glibc library).

FROM rust:1-bookworm AS build
# .git is not in the build context (.dockerignore), so build.rs cannot ask
# git: it takes the revision label of gpumem_exporter_build_info from this
# environment variable instead ("unknown" when the build arg is not given).
ARG GPUMEM_EXPORTER_REVISION=unknown
ENV GPUMEM_EXPORTER_REVISION=${GPUMEM_EXPORTER_REVISION}
WORKDIR /src
COPY . .
# Cache mounts keep the registry and target/ between builds; the binary is
# copied out of the cached target/ so it lands in the image layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gpumem-exporter \
 && cp target/release/gpumem-exporter /gpumem-exporter

# distroless/cc: glibc, libgcc, CA certificates, tzdata, no shell. Its
# :nonroot tag's uid/gid 65532 is shared by many images: under hostPID,
# processes of one uid can read each other's files through
# /proc/<pid>/root (service-account tokens included), so the exporter runs
# as a uid of its own, 60877, matching runAsUser in deploy/kubernetes. It
# lies in 60578-61183, the range systemd leaves unused (between systemd-
# homed's and nspawn's host-user range and DynamicUser's 61184-65519): no
# distribution, regular user (1000-60000) or dynamic service user gets it.
FROM gcr.io/distroless/cc-debian12:nonroot
# The version is Cargo.toml's (a test keeps the two equal); the revision is
# the one build.rs stamps into gpumem_exporter_build_info.
ARG GPUMEM_EXPORTER_VERSION=0.1.0
ARG GPUMEM_EXPORTER_REVISION=unknown
ARG GPUMEM_EXPORTER_SOURCE=https://github.com/gpumem-exporter/gpumem-exporter
LABEL org.opencontainers.image.title="gpumem-exporter" \
      org.opencontainers.image.description="Prometheus exporter for GPU memory: per GPU, per process, per pod, from NVML" \
      org.opencontainers.image.source="${GPUMEM_EXPORTER_SOURCE}" \
      org.opencontainers.image.version="${GPUMEM_EXPORTER_VERSION}" \
      org.opencontainers.image.revision="${GPUMEM_EXPORTER_REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /gpumem-exporter /gpumem-exporter
USER 60877:60877
EXPOSE 9877
ENTRYPOINT ["/gpumem-exporter"]
