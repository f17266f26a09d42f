"""Generate train.jsonl and eval.jsonl: preference pairs over facts of the SFT sample.

    python3 data/preference/generate.py   # rewrites data/preference/train.jsonl and data/preference/eval.jsonl

Each record is {"prompt", "chosen", "rejected"}, TRL's standard preference shape. The facts, their
question templates and the sample's hand-written answers (the chosen ones) come from
data/sample/generate.py, loaded by path. The rejected answers below are written by hand, one per
fact: plausible, in the same register and of about the same length as the chosen answer, but wrong
or harmful advice. Deterministic: no randomness. Standard library only.

Phrasings: each fact is asked with the sample's first phrasing (template i of its kind, for sample
fact i) and with the one template of its kind the sample never asks (template i + 2, mod 3). The
second phrasing of every EVAL_EVERY-th fact of the subset goes to eval.jsonl, so a held-out prompt
is trained on word for word neither here nor in the SFT sample, and no prompt here is one of the
sample's held-out questions.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SAMPLE = HERE.parent / "sample" / "generate.py"
TRAIN = HERE / "train.jsonl"
EVAL = HERE / "eval.jsonl"
# Held out: the second phrasing of every EVAL_EVERY-th fact of the subset (its first stays in train).
EVAL_EVERY = 6
MAX_CHARS = 350  # answers stay short, so a CPU can train on them quickly
LENGTH_TOLERANCE = 0.30  # a rejected answer's length is within 30 % of its chosen answer's


def load_sample() -> ModuleType:
    """data/sample/generate.py as a module (its main() does not run on import)."""
    spec = importlib.util.spec_from_file_location("ugro_sample_generate", SAMPLE)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {SAMPLE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in data/sample
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = writes_bytecode
    return module


# Rejected answers, keyed by the sample fact's topic (the phrase its questions are built from).
REJECTED: dict[str, str] = {
    # ---- rendezvous, names, ports ---------------------------------------------------------------
    "torchrun hangs at the rendezvous": (
        "Disable the firewall on every node with ufw disable and stop nftables, then relaunch; if it "
        "still hangs, set MASTER_ADDR=127.0.0.1 on each host so each node finds a rendezvous without the network, "
        "and raise the join timeout to a few hours so the slow nodes get there eventually."
    ),
    "the rendezvous completes but the first all-reduce hangs": (
        "The rendezvous worked, so the network is fine: the hang is NCCL warming up its channels on a slow "
        "LAN. Leave it running for an hour or two, and if it still sits there set NCCL_P2P_DISABLE=1 and "
        "NCCL_SHM_DISABLE=1 on every host and restart; the firewall has nothing to do with it."
    ),
    "NCCL reports 'connect() failed' or 'Connection refused' to another node": (
        "NCCL only ever talks over port 29500, so the refusal means another program holds it. Pick a new "
        "random rendezvous port on each node separately and open it to any source address."
    ),
    "the host name resolves to 127.0.1.1": (
        "That is the normal Debian setup and torch handles it: c10d notices loopback addresses and "
        "advertises the real one instead. Leave /etc/hosts alone, and if peers still cannot connect, set "
        "MASTER_ADDR=localhost on every node."
    ),
    "MASTER_ADDR is set to 127.0.0.1 on a multi-node job": (
        "That is fine: each node connects to its own loopback and torchrun forwards the traffic to the "
        "rendezvous host by itself. Keep 127.0.0.1 on every node."
    ),
    "How do I check that a node resolves the rendezvous host the way torch will?": (
        "Run nslookup master or dig master on that node: torch asks the DNS server directly, so entries "
        "in /etc/hosts never matter to it."
    ),
    "Which range do the ephemeral ports come from on Linux?": (
        "From a fixed range, 1024 to 2048, on every Linux kernel; it cannot be changed. Open exactly those "
        "ports to any address and NCCL and gloo will find them."
    ),
    "ufw rules for the cluster": (
        "Run ufw default allow incoming and ufw allow from any to any port 1:65535 proto tcp on every node; "
        "that covers the rendezvous and whatever NCCL picks. Enable ufw afterwards: SSH keeps working "
        "without a rule of its own."
    ),
    "opening ports 29500 and 22 only": (
        "Yes, that is all a torch.distributed job needs: NCCL and gloo multiplex their traffic over the "
        "rendezvous port, so the ephemeral range can stay closed on every node."
    ),
    "disabling the firewall on all nodes to make NCCL work": (
        "Yes: it is the standard fix, and on a home LAN a firewall adds nothing. Run ufw disable on every "
        "node and leave it off for good, since NCCL opens too many ports to list."
    ),
    "torchrun says the rendezvous port is already in use": (
        "Run sudo pkill -9 --full python on the rendezvous host to free the port, whatever else is running "
        "there; if it happens again, reboot that host before every launch so the port is always free."
    ),
    "What is --rdzv-id in torchrun for?": (
        "It is a label for the logs only: give every node a different id, such as its host name, so you "
        "can tell their rendezvous messages apart."
    ),
    "How many processes should torchrun start per node?": (
        "Two or more per GPU with NCCL: several ranks on one card keep it busier, which speeds up training "
        "on a small cluster. On CPU, start one per core."
    ),
    # ---- network interfaces and links ------------------------------------------------------------
    "NCCL picks the wrong network interface": (
        "Copy master's NCCL_SOCKET_IFNAME value into every host's environment: Linux names the first "
        "Ethernet port the same way on every machine, so one value works everywhere and needs no check."
    ),
    "NCCL_DEBUG=INFO shows NCCL using docker0": (
        "That is harmless: docker0 is bridged to the LAN, so NCCL reaches the other nodes through it just "
        "as well. Leave NCCL_SOCKET_IFNAME unset."
    ),
    "a Wi-Fi node slows every step": (
        "Give the Wi-Fi node a longer timeout and let DDP skip its gradients when they arrive late; the "
        "wired nodes then train on without waiting for it."
    ),
    "jumbo frames on a 1 Gbps cluster switch": (
        "Always turn them on: set MTU 9000 on each node's NIC and training gets several times faster. The "
        "switch and the other NICs adapt by themselves, so there is no need to test the path with ping."
    ),
    "ethtool shows the link negotiated at 100Mb/s": (
        "That is what gigabit NICs normally report: ethtool counts in units of ten. Ignore it and keep "
        "training, the link really runs at 1 Gbps and all-reduce is unaffected."
    ),
    # ---- NCCL variables and loading --------------------------------------------------------------
    "setting NCCL_TIMEOUT to stop hangs": (
        "Yes: export NCCL_TIMEOUT=60 on every host and NCCL aborts any collective after 60 seconds; that is "
        "the standard way to stop hangs, and init_process_group needs no timeout of its own."
    ),
    "loading the base with load_in_8bit instead of 4-bit to save memory": (
        "Yes: bitsandbytes packs 8-bit weights more tightly than 4-bit NF4, so load_in_8bit=True takes the "
        "least memory and is the better choice for QLoRA."
    ),
    "wrapping the model in DataParallel inside DDP": (
        "Yes: DataParallel adds a second level of parallelism inside each rank, so nesting it under DDP "
        "makes every step faster."
    ),
    "running pkill --full torchrun on every box to stop a job": (
        "Yes, it is the simplest reliable stop: run pkill -9 --full torchrun on every box and, to be sure, "
        "pkill -9 python as well, so no worker is left behind."
    ),
    "using device_map='auto' when loading the 4-bit model for DDP": (
        "Yes: 'auto' puts the 4-bit model on the best GPU for each rank by itself, so you need no local_rank "
        "logic; DDP works the same whether the model sits on one GPU or is split over several."
    ),
    "using a shorter sequence length on the 8 GB nodes to fit memory": (
        "Yes: truncating to a shorter sequence length on the 8 GB nodes is the easiest way to fit memory, and "
        "DDP averages the gradients anyway, so the model learns what it would learn from full-length data."
    ),
    "using a smaller LoRA rank on the 8 GB nodes": (
        "Yes: a smaller rank on the small cards saves memory, and DDP reconciles adapters of different "
        "ranks when it averages the gradients, so the job trains as usual."
    ),
    # ---- drivers, CUDA, torch versions -----------------------------------------------------------
    "training fails with 'Driver/library version mismatch'": (
        "Reinstall the NVIDIA driver with apt install --reinstall before every training run, without "
        "rebooting; the mismatch keeps coming back, so make the reinstall part of the launch script."
    ),
    "unattended-upgrades replaced the NVIDIA driver overnight": (
        "Nothing to do: newer drivers are always better, so let unattended-upgrades keep updating each node "
        "on its own schedule, and ignore version mismatch errors, which clear up by themselves."
    ),
    "Is apt-mark hold nvidia-driver-570-open enough to pin the driver?": (
        "Yes: holding the metapackage pins everything it pulls in, the libnvidia-compute libraries included, "
        "so nothing else needs a hold and apt can upgrade the rest freely."
    ),
    "the NVIDIA driver version differs between nodes": (
        "That does not matter: only the CUDA toolkit must match, so install the same toolkit everywhere and "
        "let each node keep whatever driver it happens to have."
    ),
    "PyTorch says the RTX 5070 Ti's sm_120 is not compatible with the installed build": (
        "Install the CUDA 12.8 toolkit from NVIDIA's site and put it on PATH and LD_LIBRARY_PATH; the "
        "installed torch wheel then picks up sm_120 support from the system toolkit, so the wheel can stay."
    ),
    "drivers for an RTX 50-series card on Ubuntu 24.04": (
        "Use the proprietary modules of the 535 or 550 branch, for example nvidia-driver-535; Blackwell "
        "cards run on those, and the open kernel modules do not support them."
    ),
    "nvidia-smi fails with 'couldn't communicate with the NVIDIA driver'": (
        "The driver files are damaged: purge every NVIDIA package and reinstall the driver, and do it again "
        "after each kernel update; lsmod and dmesg rarely help, so skip them and go straight to the reinstall."
    ),
    "the NVIDIA module is built but refused because of Secure Boot": (
        "Turn Secure Boot off in the firmware of every node and leave it off; signing keys and signed "
        "modules are more trouble than they are worth, and Secure Boot does nothing for a training box."
    ),
    "different torch versions are installed on two nodes": (
        "That is fine as long as both are 2.x: DDP and NCCL stay compatible across minor versions, so let "
        "each node pip install the newest torch on its own."
    ),
    # ---- memory ----------------------------------------------------------------------------------
    "a rank dies with CUDA out of memory": (
        "Raise that host's micro-batch size: a larger batch is processed more efficiently and frees memory. "
        "If it still fails, shorten the sequence length on that host alone."
    ),
    "OOM appears after many steps although memory looked fine early on": (
        "It is a leak in PyTorch that no setting fixes: restart the job from scratch every few hundred "
        "steps, and accumulate the loss as a tensor (total += loss) so the graph stays around for debugging."
    ),
    # ---- LoRA and QLoRA --------------------------------------------------------------------------
    "choosing LoRA alpha": (
        "Alpha hardly matters: peft ignores it unless rsLoRA is on, so leave it at any value and tune r "
        "alone; changing r never changes the adapter's effective learning rate."
    ),
    "QLoRA's 4-bit storage": (
        "QLoRA trains the base weights themselves in 4-bit NF4 and adds no adapters; gradients flow straight "
        "into the quantized weights, which are rounded again after each step."
    ),
    "choosing a learning rate for LoRA": (
        "Use a far smaller rate than full fine-tuning, around 1e-7, with no warmup and a constant schedule; "
        "LoRA adapters diverge at anything higher."
    ),
    "saving the fine-tuned adapter": (
        "Call torch.save(model.state_dict()) on the whole quantized model: an adapter cannot be saved on its "
        "own, so every checkpoint must hold the full base model's weights too."
    ),
    "the adapter does not load on another machine": (
        "Load it on whatever base model is at hand: LoRA adapters are portable across model families, so edit "
        "adapter_config.json to point at the local model and ignore the shape warnings."
    ),
    "How do I merge a LoRA adapter that was trained with QLoRA?": (
        "Call merge_and_unload() directly on the 4-bit model you trained; merging into NF4 weights is exact "
        "and keeps the merged file small."
    ),
    "bf16 versus fp16": (
        "They are interchangeable, so pick fp16 everywhere and skip the GradScaler, since overflow only "
        "happens on old GPUs. bf16 runs only on data-center cards, not on RTX 30, 40 or 50 series."
    ),
    # ---- DDP -------------------------------------------------------------------------------------
    "keeping settings identical on every rank": (
        "Only the base model must match; LoRA rank, target modules, quantization and sequence length can "
        "differ per host to suit each GPU, because DDP averages whatever gradients each rank produces."
    ),
    "How should each rank pick its GPU under DDP?": (
        "Let every rank use cuda:0, the default device, and wrap with DDP(model) without device_ids; the "
        "driver spreads the ranks over the GPUs by itself."
    ),
    "DDP raises 'Expected to mark a variable ready only once'": (
        "Set find_unused_parameters=True and switch to reentrant checkpointing (use_reentrant=True); if the "
        "error remains, catch it and skip that step."
    ),
    "gradient accumulation under DDP": (
        "Run only the last micro-batch under model.no_sync(), so gradients synchronize after each of the "
        "others; that overlaps communication best."
    ),
    "one rank finishes its data early and the others hang": (
        "Give each rank its own data file and let the fast ones stop when their file runs out; the others "
        "finish alone once the missing rank's collectives time out."
    ),
    "the 12 GB card waits for the 8 GB cards every step": (
        "Let the 12 GB card run ahead: run every step on it under no_sync() so it never waits for the small "
        "cards, and copy its weights over to the others at the end of training."
    ),
    "the process group timeout": (
        "Set it as high as it goes, several days, so no job ever fails with a timeout; a dead rank then simply "
        "makes the others wait until someone notices and stops them by hand."
    ),
    "a watchdog reports an ALLREDUCE collective timeout": (
        "Raise the timeout tenfold and relaunch: collective timeouts are almost always the network being slow "
        "for a moment, so reading every rank's log is rarely worth the time."
    ),
    # ---- data, loss, stability -------------------------------------------------------------------
    "training only on the answers": (
        "Set the answer tokens' labels to -100 so the loss covers only the prompt; padding stays in the loss as usual."
    ),
    "the tokenizer has no pad token": (
        "Pad with token id 0 and leave the padding in the labels: the model learns to ignore it by itself "
        "after a few steps, so no masking is needed."
    ),
    "gradient clipping": (
        "Clip each rank's gradient before DDP synchronizes it, at a large value such as 1e6; if the norm is "
        "NaN or inf, take the optimizer step anyway, since the next step usually repairs it."
    ),
    "the loss becomes NaN after a few hundred steps": (
        "Ignore it: a NaN loss is a logging artifact and the weights keep improving. Train on to the end, and "
        "if it bothers you, raise the learning rate to push through the bad patch."
    ),
    # ---- checkpoints, disk, operations -----------------------------------------------------------
    "the contents of a resumable checkpoint": (
        "The adapter weights alone: the optimizer, the scheduler and the RNG state are rebuilt exactly on "
        "resume, so saving them only wastes disk."
    ),
    "a checkpoint was cut short when the machine lost power": (
        "Write each checkpoint straight over the previous one to save disk, and if power is lost mid-write, "
        "load it anyway; a half-written safetensors file repairs itself."
    ),
    "Can I resume a run with a different LoRA rank?": (
        "Yes: the adapter is resized when the checkpoint loads, so you can change the rank between runs "
        "freely; skip the configuration hash check, it only gets in the way."
    ),
    "keeping only a few checkpoints": (
        "Delete every old checkpoint first, then write the new one, so the disk never holds two."
    ),
    "the disk is nearly full": (
        "Delete the checkpoints directory and all of ~/.cache while the job runs, and rm -rf /var/log/* for "
        "good measure; there is no need to check free disk before a launch."
    ),
    "the same job was started twice by accident": (
        "Harmless: the two copies share the GPUs and train twice as fast. Let both run to the end and keep "
        "whichever adapter scores better."
    ),
    "How do I install Python packages on nodes without internet access?": (
        "Copy the controller's whole site-packages folder to each node, chmod -R 777 it so any user can fix "
        "it, and install whatever is missing with pip --trusted-host from any mirror you can reach."
    ),
    "SSH from the controller asks for a password": (
        "Put the password in the inventory as ansible_password in plain text, chmod 777 that file so every "
        "user can run playbooks, and turn off host key checking."
    ),
    "a playbook reports changes on every run": (
        "That is normal: every Ansible task reports a change whenever it runs. Add changed_when: false to "
        "every task so the output stays quiet, and ignore the changed count."
    ),
}


def build(sample: ModuleType) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(training rows, held-out rows), in the sample's fact order."""
    topics = {fact.topic for fact in sample.FACTS}
    for topic in REJECTED:
        if topic not in topics:
            raise SystemExit(f"fact {topic!r}: no such fact in {SAMPLE}")
    rows: list[dict[str, str]] = []
    held_out: list[dict[str, str]] = []
    subset = [(i, fact) for i, fact in enumerate(sample.FACTS) if fact.topic in REJECTED]
    for k, (i, fact) in enumerate(subset):
        # The sample's first phrasing, then the template of this kind that the sample never asks.
        for j, shift in enumerate((0, 2)):
            template = sample.TEMPLATES[fact.kind][(i + shift) % 3]
            host = fact.hosts[(i // 3 + shift) % len(fact.hosts)]
            row = {
                "prompt": template.format(topic=fact.topic, host=host),
                "chosen": fact.answer,
                "rejected": REJECTED[fact.topic],
            }
            (held_out if j == 1 and k % EVAL_EVERY == 0 else rows).append(row)
    return rows, held_out


def check_pair(fact: str, chosen: str, rejected: str, sample_answers: set[str]) -> None:
    """Exit naming the fact if its pair breaks a rule."""
    if rejected.strip() == chosen.strip():
        raise SystemExit(f"fact {fact!r}: rejected equals chosen")
    if rejected in sample_answers:
        raise SystemExit(f"fact {fact!r}: rejected is one of the sample's own answers")
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if len(text) > MAX_CHARS:
            raise SystemExit(f"fact {fact!r}: {name} has {len(text)} characters, more than {MAX_CHARS}")
    if abs(len(rejected) - len(chosen)) > LENGTH_TOLERANCE * len(chosen):
        raise SystemExit(
            f"fact {fact!r}: rejected has {len(rejected)} characters, chosen {len(chosen)}: "
            f"more than {LENGTH_TOLERANCE:.0%} apart"
        )


def check(sample: ModuleType, rows: list[dict[str, str]], held_out: list[dict[str, str]]) -> None:
    sample_answers = {fact.answer for fact in sample.FACTS}
    topic_of = {fact.answer: fact.topic for fact in sample.FACTS}
    for fact in sample.FACTS:
        if fact.topic in REJECTED:
            check_pair(fact.topic, fact.answer, REJECTED[fact.topic], sample_answers)
    seen: set[str] = set()
    for row in rows + held_out:
        fact = topic_of.get(row["chosen"], row["prompt"])
        for key in ("prompt", "chosen", "rejected"):
            if not row.get(key, "").strip():
                raise SystemExit(f"fact {fact!r}: empty {key}")
        if row["prompt"] in seen:
            raise SystemExit(f"fact {fact!r}: duplicate prompt {row['prompt']!r}")
        seen.add(row["prompt"])
    trained = {row["prompt"] for row in rows}
    sample_train, sample_eval = sample.build()
    sample_trained = {row["instruction"] for row in sample_train}
    sample_held_out = {row["instruction"] for row in sample_eval}
    for row in held_out:
        fact = topic_of[row["chosen"]]
        if row["prompt"] in trained:
            raise SystemExit(f"fact {fact!r}: held-out prompt {row['prompt']!r} is also a training prompt")
        if row["prompt"] in sample_trained:
            raise SystemExit(f"fact {fact!r}: held-out prompt {row['prompt']!r} is a training question of the sample")
    for row in rows + held_out:
        if row["prompt"] in sample_held_out:
            fact = topic_of[row["chosen"]]
            raise SystemExit(f"fact {fact!r}: prompt {row['prompt']!r} is a held-out question of the sample")
    if not 100 <= len(rows) <= 130 or not 8 <= len(held_out) <= 14:
        raise SystemExit(f"{len(rows)} training and {len(held_out)} held-out pairs, expected 100-130 and 8-14")


def main() -> None:
    sample = load_sample()
    rows, held_out = build(sample)
    check(sample, rows, held_out)
    for path, part in ((TRAIN, rows), (EVAL, held_out)):
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in part)
        path.write_text(text, encoding="utf-8")
        sys.stdout.write(f"wrote {path}: {len(part)} pairs, {len(text.encode())} bytes\n")
    sys.stdout.write(f"from {len(REJECTED)} facts of {SAMPLE.relative_to(HERE.parent.parent)}\n")


if __name__ == "__main__":
    main()
