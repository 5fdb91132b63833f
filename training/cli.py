"""Command line of flash_attn.training: ``train``, ``generate`` and ``prepare``.

    python -m flash_attn.training train --config tiny model.n_layer=4 optim.lr=1e-3
    torchrun --nproc_per_node=8 -m flash_attn.training train --config gpt2-small dist.strategy=fsdp
    python -m flash_attn.training generate runs/tiny --prompt "the quick"
    python -m flash_attn.training prepare corpus.txt corpus.npy --tokenizer tokenizer.json

``main(argv)`` takes the subcommand first, so ``flash-attn train ...`` can hand its arguments over as is.
"""
import argparse
import sys

from flash_attn.training.config import ConfigError

COMMANDS = ("train", "generate", "prepare")


def _train(args):
    from flash_attn.training.config import load_config
    from flash_attn.training.trainer import train

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    result = train(cfg)
    if result.losses and result.is_main:
        first, last = result.losses[0][1], result.losses[-1][1]
        print(f"trained steps {result.start_step}->{result.final_step}: loss {first:.4f} -> {last:.4f}"
              + (f", checkpoint {result.checkpoint}" if result.checkpoint else ""), file=sys.stderr)
    if result.interrupted:  # checkpointed; the shell's convention for a run a signal ended: 128 + its number
        import signal

        return 128 + getattr(signal, result.interrupted, signal.SIGTERM)
    return 0


def _generate(args):
    from flash_attn.training.generate import generate

    text = generate(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens, top_k=args.top_k,
                    top_p=args.top_p, temperature=args.temperature, seed=args.seed, device=args.device)
    print(args.prompt + text)
    return 0


def _prepare(args):
    from flash_attn.training.data import prepare_tokens

    n = prepare_tokens(args.input, args.output, args.tokenizer)
    print(f"wrote {n} tokens to {args.output}", file=sys.stderr)
    return 0


def build_parser(prog="python -m flash_attn.training"):
    parser = argparse.ArgumentParser(prog=prog, description="Train GPT-2 / LLaMA-style models with flash_attn.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model from a YAML config (resumes from its latest checkpoint)")
    p.add_argument("--config", default="tiny",
                   help="a YAML file or a bundled config name: tiny, gpt2-small, gpt2-medium, llama-1b "
                        "(default: tiny)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")
    p.set_defaults(run=_train)
    g = sub.add_parser("generate", help="sample text from a checkpoint")
    g.add_argument("checkpoint", help="checkpoint file, checkpoints folder or run folder (its latest)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--top-k", type=int, default=0, help="1 = greedy, 0 = no top-k limit")
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cuda" if _cuda() else "cpu")
    g.set_defaults(run=_generate)
    r = sub.add_parser("prepare", help="tokenize a text file into a .npy token file for data.train")
    r.add_argument("input", help="UTF-8 text file")
    r.add_argument("output", help="output .npy file")
    r.add_argument("--tokenizer", default="byte", help="byte, or a tokenizers JSON file")
    r.set_defaults(run=_prepare)
    return parser


def _cuda():
    import torch

    return torch.cuda.is_available()


def main(argv=None, prog="python -m flash_attn.training"):
    """Run a subcommand (argv[0] is train, generate or prepare); returns the exit code. Bad configs, missing
    files and mismatched checkpoints print one clear line and return 2."""
    args = build_parser(prog).parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
