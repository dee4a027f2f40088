# loadlab on the Locust image: one image for the Locust master, the workers, the simulated SGLang server
# (`loadlab sim`) and a cluster of simulated servers behind a front (`loadlab cluster`, with sglang-router).
# docker-compose.yml runs them; see docs/compose.md.
#
#   docker build -t loadlab .
#   docker run --rm -p 8089:8089 -e LOADLAB_WEB_LOGIN=admin:SECRET loadlab   # web UI on :8089 with a login
#   docker run --rm loadlab locust -f locustfile.py --headless --profile-file profiles/rag.yaml
#   docker run --rm -p 30000:30000 loadlab loadlab sim --host 0.0.0.0 --port 30000 --enable-metrics
#   docker run --rm -p 30000:30000 loadlab loadlab cluster clusters/four-a100.yaml --host 0.0.0.0 --port 30000
#   deploy/k8s: the same image on Kubernetes (docs/kubernetes.md)
#
# Locust is pinned to the version loadlab is developed against (pyproject.toml: locust>=2.40,<3).
FROM locustio/locust:2.47.0

# The base image keeps Locust in a venv at /opt/venv (first on PATH, pip included) and runs as the user
# `locust`; install as root, run as `locust`.
USER root
WORKDIR /loadlab

# A regular (non-editable) install of the package and its dependencies into /opt/venv, with the `router`
# extra: sglang-router, the front of a cluster of kind router (a prebuilt manylinux wheel, no compiler).
COPY pyproject.toml README.md ./
COPY loadlab ./loadlab
RUN pip install --no-cache-dir ".[router]" && rm -rf build ./*.egg-info

COPY locustfile.py ./
COPY profiles ./profiles
COPY clusters ./clusters
COPY deploy/docker-entrypoint.sh /usr/local/bin/loadlab-entrypoint
RUN chmod 755 /usr/local/bin/loadlab-entrypoint && mkdir -p reports && chown -R locust:locust /loadlab
USER locust

# The command names the program (`locust ...` or `loadlab ...`); one that starts with a flag is Locust's, as
# with Locust's own image (its Kubernetes operator passes only `--master ...`): deploy/docker-entrypoint.sh.
# The default is Locust's web UI on :8089 with profiles/default.yaml (the embedded twin as the target),
# behind a login: a container's UI listens on every interface, so loadlab refuses it without
# LOADLAB_WEB_LOGIN=user:password (docs/web-ui.md, "Login").
ENV PYTHONUNBUFFERED=1
EXPOSE 8089 5557 30000
ENTRYPOINT ["loadlab-entrypoint"]
CMD ["locust", "-f", "locustfile.py", "--web-login"]
