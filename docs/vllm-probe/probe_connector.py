"""Out-of-tree probe: ExampleConnector + logging of everything the layout depends on."""
import json, os, time
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

LOG = os.environ.get("PROBE_LOG", "/tmp/vllm-probe/probe.jsonl")
DUMP = os.environ.get("PROBE_DUMP", "/tmp/vllm-probe/dump.pt")

def log(**kw):
    kw["t"] = round(time.time(), 3); kw["pid"] = os.getpid()
    with open(LOG, "a") as f:
        f.write(json.dumps(kw, default=str) + "\n")

def tinfo(t):
    if not isinstance(t, torch.Tensor):
        return repr(t)[:200]
    d = dict(shape=list(t.shape), dtype=str(t.dtype), stride=list(t.stride()),
             contig=t.is_contiguous(), device=str(t.device), ptr=t.data_ptr())
    if t.numel() <= 64:
        d["val"] = t.tolist()
    return d

class ProbeConnector(ExampleConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        log(ev="init", role=str(role), block_size=self._block_size,
            kv_cache_config=repr(kv_cache_config)[:1500],
            extra=self._kv_transfer_config.kv_connector_extra_config,
            policy=self._kv_transfer_config.kv_load_failure_policy,
            disable_hma=vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
            prefix_caching=vllm_config.cache_config.enable_prefix_caching)
        self._calls = 0; self._saved_layers = set(); self._kv = None

    # ---- worker side
    def register_kv_caches(self, kv_caches):
        self._kv = kv_caches
        names = list(kv_caches)
        ptrs = [kv_caches[n].data_ptr() for n in names]
        nbytes = [kv_caches[n].untyped_storage().nbytes() for n in names]
        log(ev="register_kv_caches", n=len(names), first=names[0], last=names[-1],
            info0=tinfo(kv_caches[names[0]]), storage_nbytes0=nbytes[0],
            ptr_gaps=[ptrs[i+1]-ptrs[i] for i in range(min(4, len(ptrs)-1))],
            same_storage=len({kv_caches[n].untyped_storage().data_ptr() for n in names}))

    def start_load_kv(self, forward_context, **kwargs):
        md = self._get_connector_metadata()
        am = forward_context.attn_metadata
        log(ev="start_load_kv", kwargs=list(kwargs), attn_md_type=type(am).__name__,
            attn_md_keys=(list(am)[:3] if isinstance(am, dict) else None),
            reqs=[dict(store=r.is_store, ntok=len(r.token_ids), slots0=r.slot_mapping[:3].tolist()) for r in md.requests])
        return super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name):
        return super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        if layer_name not in self._saved_layers or layer_name.endswith(".0.self_attn.attn"):
            self._saved_layers.add(layer_name)
            if layer_name.endswith(".0.self_attn.attn"):
                am = attn_metadata
                fields = {k: tinfo(v) for k, v in vars(am).items()} if hasattr(am, "__dict__") else repr(am)[:500]
                log(ev="save_kv_layer", layer=layer_name, kwargs=list(kwargs), kv=tinfo(kv_layer),
                    same_as_registered=(self._kv is not None and kv_layer.data_ptr() == self._kv[layer_name].data_ptr()),
                    attn_md_type=type(am).__name__, attn_md=fields)
        return super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        md = self._get_connector_metadata()
        for r in md.requests:
            if r.is_store and self._kv is not None:
                bs = self._block_size
                blocks = sorted(set((r.slot_mapping // bs).tolist()))
                names = list(self._kv)
                torch.save({"token_ids": r.token_ids, "slot_mapping": r.slot_mapping, "blocks": blocks,
                            "layer0": self._kv[names[0]][blocks].clone(),
                            "layerL": self._kv[names[-1]][blocks].clone(),
                            "names": names}, DUMP)
                log(ev="dumped", blocks=blocks, ntok=len(r.token_ids))
        return super().wait_for_save()

    def get_finished(self, finished_req_ids):
        if finished_req_ids:
            log(ev="get_finished", ids=list(finished_req_ids))
        return super().get_finished(finished_req_ids)

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        r = super().get_num_new_matched_tokens(request, num_computed_tokens)
        log(ev="get_num_new_matched_tokens", req=request.request_id, n_prompt=len(request.prompt_token_ids),
            num_computed_tokens=num_computed_tokens, ret=r,
            n_block_hashes=len(getattr(request, "block_hashes", []) or []),
            req_attrs=sorted(a for a in vars(request) if not a.startswith("__"))[:80])
        return r

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        log(ev="update_state_after_alloc", req=request.request_id, n_ext=num_external_tokens,
            block_ids=blocks.get_block_ids(), blocks_type=type(blocks).__name__)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, so):
        m = super().build_connector_meta(so)
        self._calls += 1
        if so.scheduled_new_reqs or self._calls <= 3 or so.finished_req_ids:
            log(ev="build_connector_meta", step=self._calls,
                new=[dict(id=n.req_id, block_ids=n.block_ids, num_computed=n.num_computed_tokens,
                          n_prompt=len(n.prompt_token_ids or [])) for n in so.scheduled_new_reqs],
                cached_ids=list(so.scheduled_cached_reqs.req_ids),
                cached_new_block_ids=list(so.scheduled_cached_reqs.new_block_ids),
                num_scheduled=dict(so.num_scheduled_tokens), finished=list(so.finished_req_ids),
                meta=[dict(store=r.is_store, ntok=len(r.token_ids)) for r in m.requests])
        return m

    def request_finished(self, request, block_ids):
        r = super().request_finished(request, block_ids)
        log(ev="request_finished", req=request.request_id, block_ids=block_ids,
            n_out=len(request.output_token_ids), status=str(request.status))
        return r
