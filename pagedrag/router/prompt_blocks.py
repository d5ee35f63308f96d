"""The block hashes a replica's engine will compute for an OpenAI request body.

The router parses, renders and tokenizes the request as the server does (the server's
protocol models; the model's chat template or the server's --chat-template; the prompt
cut into segments when the replicas reuse chunks; the tenant salt of --salt-by-api-key),
then hashes its full blocks with core.block_hash. Tools, a template sent with the request,
batched completions and malformed bodies get no hashes: the request is then routed by load
alone, and the replica answers it (or refuses it with its own error).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pagedrag.core.block_hash import BlockHash, extend_block_hashes
from pagedrag.engine.inputs import InputProcessor, ProcessedPrompt
from pagedrag.models.loader import load_tokenizer
from pagedrag.server.auth import bearer_token, tenant_cache_salt
from pagedrag.server.protocol import ChatCompletionRequest, CompletionRequest

# The router checks nothing: the replica does. These bounds only keep its tokenizer calls sane.
_MAX_MODEL_LEN = 1 << 20
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


class PromptBlocks:
    def __init__(self, model: str | None, block_size: int, salt_by_api_key: bool = False,
                 chat_template: str | None = None, chunk_reuse: bool = False):
        tokenizer = load_tokenizer(model)
        self.inputs = InputProcessor(tokenizer, len(tokenizer), _MAX_MODEL_LEN, max_num_seqs=1)
        self.inputs.segment_prompts = chunk_reuse  # as the replicas cut prompts into segments
        self.block_size = block_size
        self.salt_by_api_key = salt_by_api_key
        self.chat_template = chat_template

    def of_request(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> list[BlockHash]:
        """``of`` for a raw HTTP request: POSTs to the sampling routes with a JSON body."""
        if method != "POST" or path not in ROUTED_PATHS:
            return []
        try:
            parsed = json.loads(body)
        except ValueError:
            return []
        return self.of(path, parsed, bearer_token(headers))

    def of(self, path: str, body: object, api_key: str | None = None) -> list[BlockHash]:
        """The hashes of the prompt's full blocks; [] when the body is not one the router renders."""
        try:
            prompt = self._prompt(path, body, api_key)
        except Exception:  # noqa: BLE001 - anything malformed is the replica's to refuse
            return []
        if prompt is None:
            return []
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, prompt.token_ids, self.block_size, prompt.cache_salt)
        return hashes

    def _prompt(self, path: str, body: object, api_key: str | None) -> ProcessedPrompt | None:
        if path.endswith("/chat/completions"):
            return self._chat(ChatCompletionRequest.model_validate(body), api_key)
        if path.endswith("/completions"):
            return self._completion(CompletionRequest.model_validate(body), api_key)
        return None

    def _salt(self, request: ChatCompletionRequest | CompletionRequest, api_key: str | None) -> str | None:
        return tenant_cache_salt(api_key, request.cache_salt) if self.salt_by_api_key else request.cache_salt

    def _chat(self, request: ChatCompletionRequest, api_key: str | None) -> ProcessedPrompt | None:
        if request.tools or request.request_chat_template() is not None:
            return None
        kwargs = request.template_kwargs()
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return self.inputs.render_chat(request.conversation(), request.add_generation_prompt,
                                       self._salt(request, api_key), chunks=request.prompt_chunks, **kwargs)

    def _completion(self, request: CompletionRequest, api_key: str | None) -> ProcessedPrompt | None:
        prompts = request.engine_prompts()
        if len(prompts) != 1:  # a batch goes to one replica: routed by load
            return None
        return self.inputs.process(prompts[0], self._salt(request, api_key), chunks=request.prompt_chunks)
