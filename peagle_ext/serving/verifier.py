"""A transformers causal LM run step by step on one sequence with a KV cache, optionally
capturing the aux hidden states the drafter reads (the training convention of
peagle_ext.data.hidden_states)."""

from __future__ import annotations

import contextlib
import inspect

import torch

from ..data import check_aux_layer_ids, decoder_parts


class Verifier:
    """A transformers causal LM run step by step on one sequence with a KV cache.

    aux_layer_ids: layer ids whose INPUT residual stream is captured (id L = the final norm's
    input), the convention of peagle_ext.data.verifier_hidden_states; None = no capture.
    """

    def __init__(self, model, aux_layer_ids=None):
        self.model = model
        _, self._layers, self._norm = decoder_parts(model)
        self.num_layers = len(self._layers)
        self.aux_layer_ids = None if aux_layer_ids is None else check_aux_layer_ids(aux_layer_ids, self.num_layers)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = model.config
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        params = inspect.signature(model.forward).parameters
        # transformers >= 5.2x renamed past_key_values -> cache
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False

    def new_cache(self, capacity: int | None = None):
        """A KV cache for one sequence (capacity: the positions it must hold; a DynamicCache
        grows, so it needs none)."""
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:
            return DynamicCache()

    @staticmethod
    def crop(cache, length: int):
        """Keep the first `length` tokens of the cache."""
        cur = cache.get_seq_length()
        if length >= cur:
            return
        if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
            cache.crop(length - cur)  # new API: negative = number of tokens removed
        else:
            cache.crop(length)  # legacy API: the new absolute length

    @contextlib.contextmanager
    def capturing(self):
        """Within this block forward() also returns the aux hidden states [T, n_aux*H]."""
        if self.aux_layer_ids is None:
            raise ValueError("this Verifier was built without aux_layer_ids")
        captured = self._captured

        def hook(key):
            def fn(module, args, kwargs):
                captured[key] = args[0] if args else kwargs["hidden_states"]

            return fn

        L = self.num_layers
        handles = [
            self._layers[k].register_forward_pre_hook(hook(k), with_kwargs=True)
            for k in sorted(set(self.aux_layer_ids))
            if k < L
        ]
        if L in self.aux_layer_ids:
            handles.append(self._norm.register_forward_pre_hook(hook(L), with_kwargs=True))
        self._capturing = True
        try:
            yield self
        finally:
            self._capturing = False
            for h in handles:
                h.remove()
            captured.clear()

    def forward(self, ids: torch.Tensor, cache, start: int, *, last_only: bool = False):
        """(logits [T or 1, V], aux [T, n_aux*H] or None) of tokens `ids` [T] at positions
        start..start+T-1, appending them to `cache` (which must hold exactly `start` tokens)."""
        t = ids.shape[0]
        pos = torch.arange(start, start + t, device=self.device)[None]
        self._captured.clear()
        out = self.model(
            input_ids=ids[None].to(self.device),
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            **{self._cache_kw: cache},
        )
        aux = None
        if self._capturing:
            aux = torch.cat([self._captured[k][0] for k in self.aux_layer_ids], dim=-1)
        return out.logits[0], aux
