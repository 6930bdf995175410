# One image for every role: `asyncppo broker|learner|actor ...` (see docs/deploy.md).
# For GPU nodes build with --build-arg EXTRAS=sglang on a CUDA base image; EXTRAS=lora (the
# default) lets the learner train LoRA adapters.
FROM python:3.11-slim
ARG EXTRAS="lora"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common common
COPY broker broker
COPY actors actors
COPY learner learner
COPY deploy deploy
COPY configs configs
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"
RUN useradd --create-home --uid 10001 asyncppo
USER asyncppo
ENTRYPOINT ["asyncppo"]
