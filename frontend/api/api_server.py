"""create_app: the HTTP routes and OpenAI-shaped errors around the serving layer, behind HttpGuard and CORS."""

from __future__ import annotations

import importlib.metadata
import time

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.config import ServerConfig
from frontend.api.http_guard import BodyRefused, HttpGuard, route_path
from frontend.api.lora_adapters import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from frontend.api.protocol import ChatCompletionRequest, CompletionRequest
from frontend.api.protocol_embeddings import EmbeddingRequest
from frontend.api.protocol_messages import CountTokensRequest, MessagesRequest
from frontend.api.protocol_responses import ResponsesRequest
from frontend.api.protocol_scores import ClassifyRequest, RerankRequest, ScoreRequest
from frontend.api.protocol_tokens import DetokenizeRequest, GenerateRequest, TokenizeRequest
from frontend.api.serving import ServingContext, off_loop, stream_text
from frontend.api.serving_chat import chat_prompt, create_chat_completion
from frontend.api.serving_completion import create_completion
from frontend.api.serving_embeddings import create_embedding
from frontend.api.serving_messages import count_tokens, create_message
from frontend.api.serving_pooling import EMBEDDINGS_ROUTE, SCORE_ROUTES
from frontend.api.serving_responses import create_response
from frontend.api.serving_scores import create_classify, create_rerank, create_score
from frontend.api.stored_routes import stored_routes
from frontend.errors import ApiError, bad_request, from_validation_errors
from frontend.metrics import Metrics


def _version() -> str:
    try:
        return importlib.metadata.version("roseinfer")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout on PYTHONPATH, not installed
        return "unknown"


def create_app(ctx: ServingContext, config: ServerConfig, metrics: Metrics) -> FastAPI:
    docs = config.enable_docs  # off by default: the schema tells a prober every route and field
    app = FastAPI(title="roseinfer", version=_version(), docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)  # fmt: skip
    client = ctx.client

    # Each error in OpenAI's shape, or Anthropic's on its Messages API routes (ApiError.response)
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response(path=route_path(request.scope))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(path=route_path(request.scope))

    @app.exception_handler(BodyRefused)
    async def _body_refused(request: Request, exc: BodyRefused) -> JSONResponse:
        return exc.error.response(path=route_path(request.scope))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, str(exc.detail))
        return error.response(getattr(exc, "headers", None), path=route_path(request.scope))

    def generating() -> None:
        """A pooling server's engines have no LM head (common/pooling.py): its generation routes are 400s."""
        if ctx.pooling is not None:
            what, route = ("scores", SCORE_ROUTES) if ctx.pooling.classifies else ("embeddings", EMBEDDINGS_ROUTE)
            raise bad_request(f"this server serves {what} (--runner pooling), not text: {route}", None)

    generates = [Depends(generating)]

    @app.post("/v1/completions", dependencies=generates)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw, raw.state.request_id)

    @app.post("/v1/chat/completions", dependencies=generates)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw, raw.state.request_id)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        return await create_embedding(ctx, req, raw, raw.state.request_id)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(req: ScoreRequest, raw: Request) -> Response:
        return await create_score(ctx, req, raw, raw.state.request_id)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")  # Cohere's v2 client
    async def rerank(req: RerankRequest, raw: Request) -> Response:
        return await create_rerank(ctx, req, raw, raw.state.request_id)

    @app.post("/classify")
    async def classify(req: ClassifyRequest, raw: Request) -> Response:
        return await create_classify(ctx, req, raw, raw.state.request_id)

    def model_card(model_id: str) -> dict:
        """The base model's card, or a LoRA adapter's: its directory as root, the base model as parent (vLLM's)."""
        lora = ctx.lora(model_id)
        root, parent = (lora.path, ctx.model_name) if lora is not None else (ctx.model_name, None)
        return {"id": model_id, "object": "model", "created": int(start_time), "owned_by": "roseinfer",
                "root": root, "parent": parent, "max_model_len": ctx.max_model_len}  # fmt: skip

    @app.post("/v1/responses", dependencies=generates)
    async def responses(req: ResponsesRequest, raw: Request) -> Response:
        return await create_response(ctx, req, raw)

    @app.post("/v1/messages", dependencies=generates)  # Anthropic's Messages API
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        return await create_message(ctx, req, raw, raw.state.request_id)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest) -> dict:
        return await count_tokens(ctx, req)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(m) for m in [*ctx.base_names, *ctx.loras.refs]]}

    @app.get("/v1/models/{model_id:path}")  # :path: ids such as "org/name" hold slashes
    async def model(model_id: str) -> dict:
        ctx.check_model(model_id)
        return model_card(model_id)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraAdapterRequest) -> Response:
        return PlainTextResponse(await ctx.loras.load(client, req, ctx.base_names))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraAdapterRequest) -> Response:
        return PlainTextResponse(await ctx.loras.unload(client, req))

    @app.get("/health")
    async def health() -> Response:
        """200 while at least one engine core is up and answers the client's pings (never waits on a busy engine);
        the body lists every engine's state (ready, starting, restarting, dead)."""
        engines = [h.describe() for h in client.handles]
        if client.healthy:
            return JSONResponse({"status": "ok" if all(e["state"] == "ready" for e in engines) else "degraded",
                                 "engines": engines})  # fmt: skip
        why = client.dead or "the engine core is not ready"
        if client.dead is not None and client.resumable:
            why = f"the engine core is restarting after: {why}"
        body = ApiError(503, why, None, "engine_unavailable").body()
        return JSONResponse({**body, "status": "unavailable", "engines": engines}, status_code=503)

    @app.get("/ping")
    @app.post("/ping", operation_id="ping_post")  # one id per method: the schema's ids must be unique
    async def ping() -> Response:
        """vLLM's (and SageMaker's) name for /health."""
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        await client.refresh_stats(timeout=1.0)  # fresh scheduler numbers: no step runs while an engine is idle
        metrics.observe_loras(client.in_flight(), max_lora=len(ctx.loras.refs))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            ids = await off_loop(chat_prompt, ctx, req.messages, req.add_generation_prompt, None,
                                 req.continue_final_message, req.chat_template_kwargs, None,
                                 bool(req.add_special_tokens))  # fmt: skip
        else:
            add = req.add_special_tokens is not False
            ids = await off_loop(ctx.tokenizer.encode, req.prompt or "", add)
        body = {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}
        return {**body, "token_strs": ctx.tokenizer.pieces(ids)} if req.return_token_strs else body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        ctx.check_model(req.model)
        ctx.check_token_ids(req.tokens, "tokens")
        return {"prompt": await off_loop(ctx.tokenizer.decode, req.tokens, False)}

    @app.post("/generate", dependencies=generates)
    async def generate(req: GenerateRequest, raw: Request) -> Response:
        ctx.check_model(req.model)
        if req.n != 1:
            raise bad_request("/generate makes one completion; use /v1/completions for n > 1", "n")
        await ctx.admit(1)
        prompt = await off_loop(ctx.tokenizer.encode, req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        prompt = ctx.check_prompt(prompt, "prompt", req.truncate_prompt_tokens)
        params = ctx.sampling_params(req, ctx.max_tokens(len(prompt), req.max_tokens, "max_tokens"), None)
        return stream_text(await ctx.fan_out(f"gen-{raw.state.request_id}", [prompt], req, params))

    app.include_router(stored_routes(ctx))
    start_time = time.time()
    app.add_middleware(HttpGuard, config=config)
    if config.allowed_origins:  # outermost, so preflight requests need no API key
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_methods=config.allowed_methods or ["*"], allow_headers=config.allowed_headers or ["*"],
                           allow_credentials=config.allow_credentials, expose_headers=["X-Request-Id"])  # fmt: skip
    return app
