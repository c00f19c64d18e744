"""Start a Hugging Face model without its full weights on any rank: meta init, parallelize, load each rank's slices.

With ``--from DIR`` (a transformers model folder with safetensors), every rank builds the model under
``accelerate.init_empty_weights()`` (no parameter data), parallelizes it with its ``"auto"`` plan and fills
its shards with ``tplower.load_safetensors``, reading only the slices it holds. Without ``--from``, rank 0
first writes a small random Llama to a temporary folder, as a one-process ``save_pretrained`` would, and the
result is checked against that model in one process (logits and one training step). ``--save OUT`` writes
the (trained) model back with ``save_pretrained``: whole weights, from rank 0.

Launch (gloo on CPU, nccl when CUDA is available)::

    torchrun --nproc-per-node 2 examples/load_pretrained.py [--from DIR] [--save OUT]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tplower

SUCCESS = "OK: loaded from safetensors, each rank its slices; logits and one step equal one process"


def _small_llama(folder: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", help="a transformers model folder with safetensors weights")
    parser.add_argument("--save", help="write the model back here with save_pretrained after one step")
    args = parser.parse_args()
    import accelerate
    from transformers import AutoConfig, AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = dist.get_rank()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.source
        if folder is None:  # one folder for all ranks (rank 0's), written once
            shared = [tmp]
            dist.broadcast_object_list(shared, src=0)
            folder = shared[0]
            if rank == 0:
                _small_llama(folder)
            dist.barrier()
        with accelerate.init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        tplower.parallelize(model, mesh, "auto")
        report = tplower.load_safetensors(model, folder, device=torch.cuda.current_device() if cuda else "cpu")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"rank {rank}: {len(report.loaded)} tensors, read {report.bytes_read / 2**20:.2f} MiB "
              f"(its shards), peak RSS {peak:.0f} MiB", flush=True)
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        ids = ids.to("cuda" if cuda else "cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
        logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
        opt.step()
        if args.source is None:  # the reference: the same folder in one process
            one = AutoModelForCausalLM.from_pretrained(folder).to(ids.device)
            one_opt = torch.optim.SGD(one.parameters(), lr=0.1, foreach=True)
            want = one(input_ids=ids).logits
            want.float().square().mean().backward()
            one_opt.step()
            worst = max(float((p.full_tensor() - q).detach().abs().max()) if hasattr(p, "full_tensor")
                        else float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), one.parameters(),
                                                                       strict=True))
            off = float((logits - want).detach().abs().max())
            close = off < 1e-4 and worst < 1e-4
            ok = torch.tensor([float(close)], device=ids.device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if rank == 0:
                print(SUCCESS if ok.item() == 1.0 else f"FAILED: logits differ by {off:.3g}, parameters by {worst:.3g}",
                      flush=True)
        if args.save:
            model.save_pretrained(args.save)
            if rank == 0:
                print(f"saved whole weights to {args.save}", flush=True)
        dist.barrier()  # rank 0's folder goes when every rank is done with it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
