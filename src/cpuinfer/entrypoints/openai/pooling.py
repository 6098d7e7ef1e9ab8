"""What the pooling routes (/v1/embeddings, /score, /rerank, /classify) share: a request's inputs run as one job of
pooling requests on the engine, as a completions request's prompts are (a window of them at once, sharing steps; the
same whole-request caps, metrics and request log), and the cap on how many inputs one request may hold."""

from __future__ import annotations

from cpuinfer.engine.limits import validate_batch
from cpuinfer.entrypoints.openai.errors import APIError, to_api_error
from cpuinfer.entrypoints.openai.job import Job, Prompt
from cpuinfer.errors import InvalidRequestError
from cpuinfer.sampling_params import PoolingParams

MAX_INPUTS = 2048  # OpenAI's limit of inputs in one embeddings request; the same for documents and pairs


def check_count(count: int, field: str) -> None:
    """A request's list of inputs: refused when empty or longer than MAX_INPUTS, naming the field."""
    if count == 0:
        raise APIError(f"{field} is empty: send at least one text.", 400, field)
    if count > MAX_INPUTS:
        raise APIError(f"{field} has {count} items; at most {MAX_INPUTS} are allowed in one request.", 400, field)


async def run_pooling(
    serving, request_id: str, prompts: list[Prompt], params: PoolingParams, raw, field: str
) -> Job | None:
    """Run every prompt as a pooling request (a prompt's own params, where it has them, replace `params`); the
    finished job (each state's .pooled set), or None when the client (`raw`) left first. An engine refusal is a 400
    naming `field`, the body's list of inputs."""
    sp = params.as_sampling()
    responder = serving.responder
    try:
        try:
            validate_batch(
                [len(p.token_ids) for p in prompts], sp, serving.engine.limits, responder.window(len(prompts), 1)
            )
        except InvalidRequestError as e:
            raise to_api_error(e) from e
        job = responder.start(request_id, prompts, sp)
    except APIError as err:
        err.param = field if err.param in ("prompt", "input") else err.param
        raise
    if not await responder.run(raw, job):
        return None
    if any(s.pooled is None for s in job.states):
        raise APIError("a pooling request finished without its vector", 500)
    if responder.metrics is not None:
        responder.metrics.pooling_inputs.labels(serving.model_name, params.task).inc(len(prompts))
    return job
