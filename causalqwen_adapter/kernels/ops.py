"""The operators of the `causalqwen` namespace (torch.library): the schemas every device's kernels implement.

The modeling code looks them up by name (`dispatch.py`) and runs its torch code, the reference, where none serves.
Each operator computes, without gradient, what a torch function of the package computes:

    cauchy_linear    cauchy.cauchy_linear: (loc_S, scale_S) in W_A's dtype
    ovr_scores       cauchy.ovr_decision_scores: float32 logits of an OvR mode
    loss_tile        pass B of lm_loss.chunked_lm_loss on one tile, and the tiles of losses.chunked_ovr_loss
                     (`dispatch.TILE_*` flags; the outputs as that code's comments describe them)
    block_logsumexp  pass A's logsumexp of one block of lm_loss.chunked_lm_loss
    abs_linear       out = x |W|ᵀ: the loss's scale_S = scale_U |W_A|ᵀ without a |W_A| tensor
    abs_matmul_add   out += a |W|: the loss's scale gradient, idem
    candidate_term   candidate_loss's OvR loss over candidates without trains_location: x, ∂ℓ/∂C and the scale's
                     gradient of every position (float32, written in place)

and `<name>_applies`, registered beside a device's kernel where it serves only some inputs, says whether it serves
the arguments `dispatch.lookup` is given (the operator's own arguments; for the loss's operators a tensor of the
products' dtype and device). A device's kernels register with `torch.library.register_kernel` or C++'s `TORCH_LIBRARY_IMPL`.

Every operator has a fake (meta) kernel (`torch.library.register_fake`), so that FakeTensorMode and
`torch.compile(fullgraph=True)` trace them: the outputs' shapes and dtypes (none for the in-place operators), and a
query's answer from the device's own query (`add_query`: they read shapes, dtypes and devices only), False for a
device with none.

Package only, never remote code: the namespace is process-wide, so the operators are defined once, by the package.
"""

import torch

SCHEMAS = (
    "cauchy_linear(Tensor loc_U, Tensor scale_U, Tensor weight, Tensor? bias) -> (Tensor, Tensor)",
    "cauchy_linear_applies(Tensor loc_U, Tensor scale_U, Tensor weight, Tensor? bias) -> bool",
    "ovr_scores(Tensor loc_S, Tensor scale_S, Tensor threshold, bool relative, str distribution) -> Tensor",
    "ovr_scores_applies(Tensor loc_S, Tensor scale_S, Tensor threshold, bool relative, str distribution) -> bool",
    "loss_tile(Tensor loc, Tensor? bias, Tensor lse, Tensor threshold, bool relative, Tensor? scale, Tensor col, "
    "Tensor? degenerate, float ce, float of, int flags, Tensor(a!)? d, Tensor(b!)? g, Tensor(c!) rows_out, "
    "Tensor(d!) col_d, Tensor(e!) col_t, int threads) -> ()",
    "loss_tile_applies(Tensor products) -> bool",
    "block_logsumexp(Tensor(a!) loc, Tensor? bias, bool store_bias, Tensor(b!) lse, int threads) -> ()",
    "block_logsumexp_applies(Tensor products) -> bool",
    "abs_linear(Tensor x, Tensor weight, Tensor(a!) out) -> ()",
    "abs_linear_applies(Tensor products) -> bool",
    "abs_matmul_add(Tensor a, Tensor weight, Tensor(a!) out) -> ()",
    "abs_matmul_add_applies(Tensor products) -> bool",
    "candidate_term(Tensor loc, Tensor scale, Tensor widen, Tensor weight, Tensor ids, Tensor shift, Tensor sign, "
    "Tensor minus_weight, Tensor(a!) x, Tensor(b!)? d_thr, Tensor(c!)? grad_scale) -> ()",
    "candidate_term_applies(Tensor products) -> bool",
)

library = torch.library.Library("causalqwen", "FRAGMENT")  # kept: the definitions live as long as it does


def _defined(name: str) -> bool:
    try:
        getattr(torch.ops.causalqwen, name)
    except (AttributeError, RuntimeError):
        return False
    return True


for _schema in SCHEMAS:
    if not _defined(_schema.split("(", 1)[0]):  # a second import of this file (another sys.path entry) adds nothing
        library.define(_schema)


# the queries registered per (operator, device type), which the fake `<name>_applies` asks
QUERIES = {}


def add_query(name: str, device_type: str, query) -> None:
    """Records ``query``, registered as `causalqwen::<name>_applies` for ``device_type``, for the fake query."""
    QUERIES[(name, device_type)] = query


def _fake_query(name: str):
    def fake(*args):
        tensor = next(a for a in args if torch.is_tensor(a))
        query = QUERIES.get((name, tensor.device.type))
        return bool(query(*args)) if query is not None else False

    return fake


def _fake_cauchy_linear(loc_U, scale_U, weight, bias):
    shape = (*loc_U.shape[:-1], weight.shape[0])
    return (weight.new_empty(shape), weight.new_empty(shape))  # W's dtype, contiguous, as every kernel's


def _fake_ovr_scores(loc_S, scale_S, threshold, relative, distribution):
    return loc_S.new_empty(loc_S.shape, dtype=torch.float32)


def _fake_in_place(*args):
    return None  # the outputs are arguments, written in place


FAKES = {"cauchy_linear": _fake_cauchy_linear, "ovr_scores": _fake_ovr_scores, "loss_tile": _fake_in_place,
         "block_logsumexp": _fake_in_place, "abs_linear": _fake_in_place, "abs_matmul_add": _fake_in_place,
         "candidate_term": _fake_in_place}

for _name, _fake in FAKES.items():
    for _op, _impl in ((_name, _fake), (f"{_name}_applies", _fake_query(_name))):
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"causalqwen::{_op}", "Meta"):  # a second import
            continue
        torch.library.register_fake(f"causalqwen::{_op}", _impl, lib=library)
