"""Generate train.jsonl and eval.jsonl: hand-written answers, each asked in a few phrasings.

    python3 data/sample/generate.py   # rewrites data/sample/train.jsonl and data/sample/eval.jsonl

Every answer below is written by hand. Each fact is asked in two phrasings taken from the three
templates of its kind (host names rotate through the reference cluster), and a few extra records
carry an "input" (an error message or a config excerpt) and are asked once. Deterministic: no
randomness, so the same script always writes the same file. Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal, NamedTuple

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.jsonl"
EVAL = HERE / "eval.jsonl"
# Held out: the second phrasing of every EVAL_EVERY-th fact. The model is trained on the first phrasing of
# that fact and asked the other one: the evaluation measures whether a fine-tune taught the fact itself,
# not a string, and no evaluation question is ever trained on word for word.
EVAL_EVERY = 8
HOSTS: tuple[str, ...] = ("master", "node4070", "node3070")

Kind = Literal["S", "C", "T", "A", "Q"]


class Fact(NamedTuple):
    """One hand-written answer and the phrase its questions are built from.

    kind S: a symptom seen on one host ("torchrun hangs at the rendezvous");
    kind C: a symptom of the whole cluster ("the clocks of the nodes disagree");
    kind T: a topic, as a noun phrase ("choosing LoRA alpha");
    kind A: advice to check, as a noun phrase ("setting NCCL_TREE_THRESHOLD");
    kind Q: a complete question.
    hosts: the hosts a symptom may be reported on (an OOM belongs on an 8 GB node).
    """

    kind: Kind
    topic: str
    answer: str
    hosts: tuple[str, ...] = HOSTS


class Example(NamedTuple):
    """A record with an input: asked once, exactly as written."""

    instruction: str
    input: str
    output: str


TEMPLATES: dict[Kind, tuple[str, str, str]] = {
    "S": (
        "What should I do when {topic}?",
        "On {host}, {topic}. What is the cause and the fix?",
        "Problem on {host}: {topic}. How do I fix it?",
    ),
    "C": (
        "What should I do when {topic}?",
        "Our cluster has a problem: {topic}. How do I fix it?",
        "In a three-node LoRA cluster, {topic}. What is going on and what should I change?",
    ),
    "T": (
        "Explain briefly: {topic}.",
        "I run a small GPU cluster ({host} and two more boxes on a LAN). What should I know about {topic}?",
        "Give me the short answer on {topic}.",
    ),
    "A": (
        "A setup guide recommends {topic}. Should I follow it?",
        "Is {topic} a good idea on our LAN training cluster?",
        "A colleague suggests {topic}. Is that right?",
    ),
    "Q": (
        "{topic}",
        "Short answer, please: {topic}",
        "Context: a LoRA fine-tuning cluster of {host} and two other GPU boxes on 1 Gbps Ethernet. {topic}",
    ),
}

SMALL = ("node3070", "node4070")  # the 8 GB cards
BIG = ("master",)  # the RTX 5070 Ti

FACTS: list[Fact] = [
    # ---- rendezvous, names, ports ---------------------------------------------------------------
    Fact(
        "S",
        "torchrun hangs at the rendezvous",
        "Check that the host reaches the rendezvous endpoint (nc -zv master 29500), that every node resolves "
        "every other node's name, and that the firewall allows the cluster subnet; if names are the problem, "
        "pass --local-addr with the node's cluster address.",
        SMALL,
    ),
    Fact(
        "C",
        "the rendezvous completes but the first all-reduce hangs",
        "The rendezvous port works but the backend's own connections do not: NCCL and gloo connect back on "
        "ephemeral ports. Allow the ephemeral range (32768-60999 by default) from the cluster subnet, and "
        "check NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME on each host.",
    ),
    Fact(
        "S",
        "NCCL reports 'connect() failed' or 'Connection refused' to another node",
        "NCCL opens connections back on ephemeral ports, not only on 29500. Allow the rendezvous port and the "
        "ephemeral range from the cluster subnet, and only from it, on every node.",
    ),
    Fact(
        "C",
        "the c10d rendezvous advertises a host name the other nodes cannot resolve",
        "c10d advertises rank 0 by its fully qualified host name. Render /etc/hosts on every node with every "
        "node's cluster address and name, or start torchrun with --local-addr set to the node's address.",
    ),
    Fact(
        "S",
        "the host name resolves to 127.0.1.1",
        "Debian and Ubuntu map the machine's own name to 127.0.1.1 in /etc/hosts, so other nodes would be told "
        "to connect to a loopback address. Map the name to the cluster address instead, or pass --local-addr.",
    ),
    Fact(
        "C",
        "MASTER_ADDR is set to 127.0.0.1 on a multi-node job",
        "Loopback only works on one machine. Every node must reach the rendezvous host, so use its cluster "
        "address or a name every node resolves to that address.",
    ),
    Fact(
        "Q",
        "How do I check that a node resolves the rendezvous host the way torch will?",
        "Run getent hosts master on that node: it goes through /etc/nsswitch.conf like the C library does, unlike "
        "dig or nslookup, which only ask DNS.",
    ),
    Fact(
        "Q",
        "How do I test from a worker node that the rendezvous port is reachable?",
        "Run nc -zv master 29500 from the worker while the job or a listener is up on master, and ss -tlnp | "
        "grep 29500 on master to see that something listens on the right address.",
    ),
    Fact(
        "T",
        "the ports a torch.distributed job needs",
        "The rendezvous port (29500 by default) on the rendezvous host, plus ephemeral ports between every pair "
        "of hosts, because NCCL and gloo listen on ports the kernel picks and connect back to them.",
    ),
    Fact(
        "Q",
        "Which range do the ephemeral ports come from on Linux?",
        "From net.ipv4.ip_local_port_range, 32768 to 60999 by default; read it with cat "
        "/proc/sys/net/ipv4/ip_local_port_range and open that range to the cluster subnet only.",
    ),
    Fact(
        "T",
        "ufw rules for the cluster",
        "Allow the cluster subnet only, for example: ufw allow from 192.168.1.0/24 to any port 29500 proto tcp, "
        "and ufw allow from 192.168.1.0/24 to any port 32768:60999 proto tcp; keep SSH allowed before enabling "
        "ufw.",
    ),
    Fact(
        "T",
        "nftables rules for the cluster",
        "In the input chain add: ip saddr 192.168.1.0/24 tcp dport { 29500, 32768-60999 } accept. Leave the "
        "rest of the ruleset as it is and keep SSH allowed.",
    ),
    Fact(
        "A",
        "opening ports 29500 and 22 only",
        "Not enough: the rendezvous succeeds but NCCL and gloo then connect back on ephemeral ports and hang. "
        "Allow the rendezvous port and the ephemeral range from the cluster subnet.",
    ),
    Fact(
        "A",
        "disabling the firewall on all nodes to make NCCL work",
        "No: open exactly what the job needs, the rendezvous port and the ephemeral range, and only from the "
        "cluster subnet. A disabled firewall exposes every listening service on the LAN.",
    ),
    Fact(
        "C",
        "the rendezvous times out",
        "One node did not start torchrun or cannot reach the rendezvous host. Read every host's launch log and "
        "check the firewall and name resolution on the rendezvous host.",
    ),
    Fact(
        "S",
        "torchrun says the rendezvous port is already in use",
        "Another job, or a stale one, still holds the port. Find it with ss -tlnp | grep 29500 and stop that "
        "job by its recorded process group, or choose another rendezvous port in the inventory.",
    ),
    Fact(
        "T",
        "the difference between static and c10d rendezvous",
        "c10d rendezvous lets nodes join in any order and assigns their ranks; a static rendezvous needs each "
        "node's rank, MASTER_ADDR and MASTER_PORT fixed up front.",
    ),
    Fact(
        "Q",
        "What does a typical torchrun command for three nodes with one GPU each look like?",
        "torchrun --nnodes=3 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=master:29500 "
        "--rdzv-id=job42 -m train.worker, run with the same arguments on every node.",
    ),
    Fact(
        "Q",
        "What is --rdzv-id in torchrun for?",
        "It names the job: all nodes of one job must pass the same id, and a new job should use a new one so it "
        "never joins a stale rendezvous.",
    ),
    Fact(
        "Q",
        "What does --nnodes=2:3 mean in torchrun?",
        "It is an elastic range: the job starts once at least two nodes have joined and accepts up to three.",
    ),
    Fact(
        "T",
        "--max-restarts in torchrun",
        "With --max-restarts=0 a failed worker ends the job at once, which is clearer than silent restarts when "
        "a configuration error is the cause.",
    ),
    Fact(
        "Q",
        "How many processes should torchrun start per node?",
        "One per GPU with the NCCL backend. On a CPU-only machine two processes with the gloo backend are enough "
        "to exercise the distributed code path.",
    ),
    Fact(
        "T",
        "RANK versus LOCAL_RANK",
        "RANK is the process's index in the whole job; LOCAL_RANK is its index on its own host and picks the "
        "GPU it uses.",
    ),
    Fact(
        "T",
        "WORLD_SIZE",
        "WORLD_SIZE is the number of processes in the job across all hosts; torchrun sets it for every worker "
        "together with RANK and LOCAL_RANK.",
    ),
    Fact(
        "T",
        "hosts file entries for the cluster",
        "Every node gets an /etc/hosts line for every node's cluster address and name, rendered from the "
        "inventory, so resolution does not depend on the router's DNS.",
    ),
    Fact(
        "C",
        "names resolve to IPv6 addresses first but the firewall only allows IPv4",
        "Keep the cluster on one address family: put IPv4 addresses in /etc/hosts for the cluster names, or "
        "open the same ports for IPv6 too.",
    ),
    # ---- network interfaces and the link ------------------------------------------------------------
    Fact(
        "S",
        "NCCL picks the wrong network interface",
        "Set NCCL_SOCKET_IFNAME on that host to the interface that holds its cluster address. Names differ "
        "between machines (eno1, enp5s0), so detect it per host rather than copying one value everywhere.",
    ),
    Fact(
        "S",
        "gloo picks the wrong network interface",
        "Set GLOO_SOCKET_IFNAME on that host to the interface that holds its cluster address, the same one "
        "NCCL_SOCKET_IFNAME names there.",
    ),
    Fact(
        "S",
        "NCCL_DEBUG=INFO shows NCCL using docker0",
        "Point NCCL_SOCKET_IFNAME at the host's real cluster interface, or exclude virtual ones with "
        "NCCL_SOCKET_IFNAME=^docker0,lo.",
    ),
    Fact(
        "Q",
        "How do I find which interface a host uses for its cluster address?",
        "ip -br addr lists interfaces with their addresses; ip route get <peer address> shows the interface the "
        "kernel uses to reach another node.",
    ),
    Fact(
        "A",
        "putting one NCCL_SOCKET_IFNAME value in group_vars for all nodes",
        "Only if every node really has the same interface name. Onboard and add-in NICs get different names "
        "(eno1, enp5s0), so detect each host's cluster interface and render it per host.",
    ),
    Fact(
        "Q",
        "How can Ansible find the interface that holds a host's cluster address?",
        "Loop over ansible_facts.interfaces and pick the one whose ipv4.address equals the host's cluster "
        "address; ansible_default_ipv4.interface is only the default route's interface, which may differ.",
    ),
    Fact(
        "C",
        "a Wi-Fi node slows every step",
        "Each optimizer step waits for the slowest all-reduce, and Wi-Fi latency and jitter stall it. Put every "
        "training node on wired Ethernet.",
    ),
    Fact(
        "T",
        "jumbo frames on a 1 Gbps cluster switch",
        "They help a little at best, and every NIC and switch port on the path must agree on the MTU or large "
        "packets vanish and connections stall; test with ping -M do -s 8972 and measure before keeping them.",
    ),
    Fact(
        "Q",
        "How do I check the raw link speed between two nodes?",
        "Run iperf3 -s on one node and iperf3 -c <node> on the other; 1 Gbps Ethernet should show about 940 "
        "Mbit/s. ethtool <interface> shows the negotiated speed.",
    ),
    Fact(
        "S",
        "ethtool shows the link negotiated at 100Mb/s",
        "A bad cable or port is the usual cause; replace the cable with a Cat5e or better one and check the "
        "switch port. A 100 Mbit link makes every all-reduce ten times slower.",
    ),
    Fact(
        "T",
        "expected all-reduce bandwidth on 1 Gbps Ethernet",
        "About 110 to 117 MB/s of bus bandwidth at best. LoRA keeps the gradient small, which is why 1 GbE is "
        "workable for adapter fine-tuning.",
    ),
    Fact(
        "Q",
        "How should I measure all-reduce bandwidth between the nodes?",
        "Time an all-reduce of a large tensor with the real backend and report bus bandwidth as 2(n-1)/n times "
        "the size divided by the time, the definition nccl-tests uses.",
    ),
    Fact(
        "Q",
        "How much data does DDP send per step for a LoRA adapter on a 7B model?",
        "With r=16 on all linear layers the adapter has about 40 million parameters, so about 160 MB of fp32 "
        "gradients, roughly 2 seconds per all-reduce on 1 GbE; more micro-steps per optimizer step amortize it.",
    ),
    Fact(
        "T",
        "gradient compression on Ethernet",
        "Registering DDP's bf16_compress_hook halves the bytes sent for fp32 gradients with NCCL, which helps on "
        "1 GbE; the loss of precision is small for adapter gradients.",
    ),
    Fact(
        "A",
        "setting NCCL_IB_DISABLE=1 on an Ethernet-only cluster",
        "Harmless and fine: it tells NCCL not to look for InfiniBand and to use sockets.",
    ),
    # ---- obsolete or wrong knobs ------------------------------------------------------------------
    Fact(
        "A",
        "setting NCCL_TREE_THRESHOLD",
        "No. NCCL_TREE_THRESHOLD has had no effect since NCCL 2.5; leave it out and let NCCL choose its algorithms.",
    ),
    Fact(
        "A",
        "setting NCCL_TIMEOUT to stop hangs",
        "NCCL_TIMEOUT is not an NCCL variable and does nothing. Pass timeout=timedelta(...) to "
        "init_process_group; a collective that waits longer then fails with an error.",
    ),
    Fact(
        "A",
        "forcing NCCL_ALGO=Ring and NCCL_PROTO=Simple",
        "Leave both unset. NCCL tunes algorithm and protocol itself, and forcing them usually makes things "
        "slower or hides the real problem.",
    ),
    Fact(
        "A",
        "setting NCCL_IB_TIMEOUT=5000 for a five-second timeout",
        "No: NCCL_IB_TIMEOUT is an InfiniBand exponent, not milliseconds, and it does nothing on Ethernet. Use "
        "the process group timeout for hangs.",
    ),
    Fact(
        "A",
        "loading the base with load_in_8bit instead of 4-bit to save memory",
        "No: 8-bit weights take about twice the memory of 4-bit NF4. For QLoRA load in 4-bit NF4 with double "
        "quantization and a bf16 compute dtype.",
    ),
    Fact(
        "A",
        "wrapping the model in DataParallel inside DDP",
        "No. Use DDP alone with one process per GPU; DataParallel is single-process, slower, and nesting it "
        "under DDP is unsupported.",
    ),
    Fact(
        "A",
        "running pkill --full torchrun on every box to stop a job",
        "No: it also kills unrelated jobs and anything whose command line mentions torchrun. Stop the job's "
        "own process group, recorded at launch, on each host.",
    ),
    Fact(
        "A",
        "using device_map='auto' when loading the 4-bit model for DDP",
        "No: on a multi-GPU host 'auto' can spread one model across GPUs, silently turning DDP into model "
        "parallelism. Use device_map={'': local_rank} so each rank holds a whole copy on its own GPU.",
    ),
    Fact(
        "A",
        "using a shorter sequence length on the 8 GB nodes to fit memory",
        "No: sequence length is cluster-wide, and shorter truncation on some ranks silently changes what the "
        "model learns. Lower those hosts' micro-batch size or enable gradient checkpointing there.",
    ),
    Fact(
        "A",
        "using a smaller LoRA rank on the 8 GB nodes",
        "No: DDP needs identical trainable parameters on every rank. LoRA rank, alpha, target modules and "
        "quantization must match; change only rank-local knobs per host.",
    ),
    # ---- drivers, CUDA, wheels ------------------------------------------------------------------
    Fact(
        "S",
        "training fails with 'Driver/library version mismatch'",
        "The NVIDIA user-space libraries were upgraded while the old kernel module is still loaded. Reboot the "
        "host, then hold the driver packages so it cannot happen silently again.",
    ),
    Fact(
        "C",
        "unattended-upgrades replaced the NVIDIA driver overnight",
        "Hold every package of the driver branch with apt-mark hold and add them to "
        "Unattended-Upgrade::Package-Blacklist; upgrade the driver on purpose, on all nodes together, with a "
        "reboot.",
    ),
    Fact(
        "Q",
        "Is apt-mark hold nvidia-driver-570-open enough to pin the driver?",
        "Not quite: the libraries (libnvidia-compute-570 and friends) are separate packages that can still "
        "move. Hold every installed package of the branch, or pin its version in /etc/apt/preferences.d.",
    ),
    Fact(
        "T",
        "holding a package with apt",
        "apt-mark hold keeps an installed package at its version and apt-mark showhold lists holds; an apt "
        "preferences pin also stops other sources from offering a newer one. Ansible can set holds with "
        "ansible.builtin.dpkg_selections.",
    ),
    Fact(
        "S",
        "apt says the NVIDIA packages 'have been kept back'",
        "That is the hold doing its job. Upgrade the driver deliberately: unhold, upgrade the same branch on "
        "every node, reboot, and hold again.",
    ),
    Fact(
        "C",
        "the NVIDIA driver version differs between nodes",
        "PyTorch wheels bundle the CUDA runtime and NCCL, so the driver is the piece that must match. Install "
        "the same driver branch and version everywhere and hold it.",
    ),
    Fact(
        "Q",
        "How do I compare driver versions across the nodes quickly?",
        "Run nvidia-smi --query-gpu=name,driver_version --format=csv,noheader on every node, for example with "
        "an ad-hoc Ansible command, and compare the lines.",
    ),
    Fact(
        "S",
        "PyTorch says the RTX 5070 Ti's sm_120 is not compatible with the installed build",
        "RTX 50-series (sm_120) needs PyTorch wheels built for CUDA 12.8 or newer, such as the cu128 index, a "
        "driver branch 570 or newer and the open kernel modules. The installed CUDA toolkit does not matter "
        "here.",
        BIG,
    ),
    Fact(
        "Q",
        "How do I check that the installed torch supports the RTX 50-series?",
        'python -c "import torch; print(torch.version.cuda, torch.cuda.get_arch_list())" must show CUDA 12.8 '
        "or newer and sm_120 in the list.",
    ),
    Fact(
        "T",
        "drivers for an RTX 50-series card on Ubuntu 24.04",
        "Blackwell cards need the open kernel modules from a 570 or newer branch, for example "
        "nvidia-driver-570-open; the proprietary modules do not support them.",
    ),
    Fact(
        "Q",
        "Can the RTX 3070 Ti and RTX 4070 use the open kernel modules too?",
        "Yes, the open modules support Turing and newer, so one open driver branch (570 or newer) can serve all "
        "three nodes, which keeps the driver identical across the cluster.",
    ),
    Fact(
        "T",
        "the CUDA toolkit on training nodes",
        "PyTorch wheels bundle the CUDA runtime, cuBLAS and NCCL; the toolkit (nvcc) is needed only to compile "
        "extensions. The driver must be new enough for the wheel's CUDA version.",
    ),
    Fact(
        "A",
        "installing CUDA toolkit 12.8 to make the RTX 5070 Ti work with an older torch wheel",
        "No: the wheel ships its own CUDA runtime, so a system toolkit changes nothing. Install a torch build "
        "made for CUDA 12.8 or newer.",
        BIG,
    ),
    Fact(
        "S",
        "nvidia-smi fails with 'couldn't communicate with the NVIDIA driver'",
        "The kernel module is not loaded: check lsmod | grep nvidia and dmesg. Common causes are a kernel "
        "update whose module was not built, Secure Boot refusing an unsigned module, or nouveau holding the "
        "card.",
    ),
    Fact(
        "S",
        "the NVIDIA module is built but refused because of Secure Boot",
        "Check with mokutil --sb-state. Either enroll the DKMS signing key with mokutil --import and confirm it "
        "at the next boot, or use Ubuntu's prebuilt signed linux-modules-nvidia packages.",
    ),
    Fact(
        "S",
        "nouveau is loaded instead of the NVIDIA driver",
        "Blacklist nouveau in /etc/modprobe.d, run update-initramfs -u and reboot before installing the NVIDIA driver.",
    ),
    Fact(
        "S",
        "nvidia-smi says no devices were found",
        "Check that lspci shows the GPU, that the nvidia module is loaded (lsmod) and dmesg for errors; a kernel "
        "update without a rebuilt module, or a badly seated card, are common causes.",
    ),
    Fact(
        "S",
        "the NVIDIA module disappears after a kernel update",
        "The module was not rebuilt for the new kernel. Install the matching headers so DKMS can build it (dkms "
        "status shows the state), or install the prebuilt linux-modules-nvidia package for that kernel.",
    ),
    Fact(
        "Q",
        "What does the NVIDIA driver version have to do with the torch wheel?",
        "Each CUDA release lists a minimum driver, and CUDA 12.8 pairs with the 570 branch, which RTX 50-series "
        "cards need anyway. Keep the driver at least that new and identical on every node; a newer driver runs "
        "wheels built for older CUDA releases.",
    ),
    Fact(
        "C",
        "different torch versions are installed on two nodes",
        "Install one lock file on every node, ideally from a wheelhouse the controller builds once, so torch, "
        "NCCL, transformers and peft are identical everywhere.",
    ),
    Fact(
        "Q",
        "How do I see which NCCL version torch uses?",
        'python -c "import torch; print(torch.cuda.nccl.version())"; it comes from the nvidia-nccl pip '
        "package, not from the system.",
    ),
    Fact(
        "T",
        "GPU persistence mode",
        "nvidia-smi -pm 1 or the nvidia-persistenced service keeps the driver initialized between jobs, which "
        "shortens CUDA start-up; it does not change training results.",
    ),
    # ---- memory and OOM -----------------------------------------------------------------------------
    Fact(
        "S",
        "a rank dies with CUDA out of memory",
        "Lower that host's micro-batch size or turn on gradient checkpointing in its memory profile. Those "
        "knobs are rank-local; never shorten the sequence length on one host.",
        SMALL,
    ),
    Fact(
        "S",
        "OOM happens only on the longest batches",
        "Cap the micro-batch by a token budget rather than a sequence count on that host, or enable gradient "
        "checkpointing there; the global batch and the sequence length stay the same.",
        SMALL,
    ),
    Fact(
        "T",
        "rank-local knobs in a per-host memory profile",
        "Micro-batch size (or a token budget per micro-batch), gradient checkpointing, activation offload and "
        "data-loader workers. Everything that changes the model or the data is cluster-wide.",
    ),
    Fact(
        "C",
        "a host's memory profile overrides lora.r",
        "Reject it before launch with an error naming the host and the key: LoRA rank is cluster-wide, and "
        "different ranks on different hosts break DDP.",
    ),
    Fact(
        "T",
        "the batch size on small cards",
        "Keep the global batch fixed and let small cards run smaller micro-batches with more accumulation; the "
        "optimizer then sees the same batch.",
    ),
    Fact(
        "T",
        "gradient checkpointing",
        "It stores fewer activations and recomputes them in the backward pass, cutting activation memory a lot "
        "for roughly 20 to 35 percent more compute; enable it only on hosts that need the memory.",
    ),
    Fact(
        "Q",
        "Does a 7B model fit on an 8 GB card for QLoRA?",
        "Usually: the 4-bit weights take about 3.5 to 4 GB, leaving room for the adapter, its optimizer state "
        "and activations at a small micro-batch with gradient checkpointing and a moderate sequence length.",
    ),
    Fact(
        "Q",
        "How do I see how much GPU memory a rank really needs?",
        "Print torch.cuda.max_memory_allocated() after a few steps and compare it with the card's memory; "
        "nvidia-smi also counts the allocator's cache and the CUDA context.",
    ),
    Fact(
        "S",
        "OOM appears after many steps although memory looked fine early on",
        "Fragmentation or longer batches later in the data; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "and budget the micro-batch by tokens. Make sure nothing keeps tensors with history, such as the loss "
        "summed without .item() or .detach().",
        SMALL,
    ),
    Fact(
        "S",
        "another process already holds GPU memory",
        "nvidia-smi lists the processes per GPU; stop the other job, or a desktop session using the card, "
        "before training.",
    ),
    Fact(
        "Q",
        "How do I emulate an 8 GB card on a bigger GPU for testing?",
        "torch.cuda.set_per_process_memory_fraction caps what the process may allocate, for example 8/12 on a "
        "12 GB card.",
    ),
    Fact(
        "T",
        "the host swapping during training",
        "Reduce data-loader workers and pinned-memory buffers, and keep the tokenized dataset on disk rather "
        "than in every worker's memory.",
    ),
    # ---- LoRA / QLoRA -----------------------------------------------------------------------------
    Fact(
        "T",
        "how LoRA works",
        "LoRA freezes the base weights and learns a low-rank update B·A for chosen linear layers, scaled by "
        "alpha/r; only A and B are trained, so gradients and optimizer state stay small.",
    ),
    Fact(
        "T",
        "choosing LoRA rank",
        "r=8 to 16 suits most instruction tuning; larger ranks add capacity and memory. It must be the same on "
        "every rank of the job.",
    ),
    Fact(
        "T",
        "choosing LoRA alpha",
        "A common start is alpha equal to twice the rank, such as r=16 and alpha=32; the update is scaled by "
        "alpha/r, so changing r without alpha also changes the effective learning rate.",
    ),
    Fact(
        "T",
        "rsLoRA scaling",
        "With use_rslora=True peft scales the update by alpha/sqrt(r) instead of alpha/r, which keeps larger "
        "ranks from learning too slowly.",
    ),
    Fact(
        "T",
        "choosing LoRA target modules for a Llama model",
        "Targeting all linear projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) "
        "usually trains better than attention alone, at a modest cost in adapter size.",
    ),
    Fact(
        "Q",
        "How many trainable parameters does LoRA add per adapted weight matrix?",
        "r·(d_in + d_out): for a 4096 by 4096 projection at r=16 that is 131,072 parameters.",
    ),
    Fact(
        "Q",
        "Why does a freshly created LoRA model give exactly the base model's output?",
        "peft initializes B to zero, so B·A is zero and the adapter starts as a no-op; training moves it away "
        "from zero.",
    ),
    Fact(
        "T",
        "LoRA dropout",
        "A dropout of 0.05 to 0.1 on the adapter input regularizes small datasets; set it to 0 for large ones.",
    ),
    Fact(
        "T",
        "QLoRA's 4-bit storage",
        "QLoRA keeps the frozen base weights in 4-bit NF4 and trains LoRA adapters in higher precision; the "
        "weights are dequantized on the fly for each matmul.",
    ),
    Fact(
        "Q",
        "What is a good BitsAndBytesConfig for QLoRA?",
        'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, '
        "bnb_4bit_compute_dtype=torch.bfloat16).",
    ),
    Fact(
        "T",
        "double quantization in QLoRA",
        "It quantizes the per-block scaling constants too, saving about 0.4 bits per parameter, roughly 3 GB on "
        "a 65B model and a few hundred MB on a 7B one.",
    ),
    Fact(
        "Q",
        "What does prepare_model_for_kbit_training do?",
        "It readies a 4-bit model for training: casts the non-quantized parameters such as layer norms to "
        "fp32, makes the inputs require gradients "
        "and can enable gradient checkpointing; pass gradient_checkpointing_kwargs={'use_reentrant': False}.",
    ),
    Fact(
        "T",
        "the optimizer for LoRA",
        "AdamW over the adapter parameters only; its state is small because the base is frozen. Paged 8-bit "
        "AdamW from bitsandbytes saves a little more on small cards.",
    ),
    Fact(
        "T",
        "choosing a learning rate for LoRA",
        "LoRA tolerates higher learning rates than full fine-tuning, typically 1e-4 to 3e-4 for large models, "
        "with a short warmup and a cosine decay.",
    ),
    Fact(
        "T",
        "weight decay on LoRA adapters",
        "Zero or a small value such as 0.01 is common; it matters much less than the learning rate.",
    ),
    Fact(
        "T",
        "saving the fine-tuned adapter",
        "peft's save_pretrained writes adapter_model.safetensors and adapter_config.json: only the LoRA weights "
        "and settings, which load on top of the same base model.",
    ),
    Fact(
        "S",
        "the adapter does not load on another machine",
        "An adapter only fits the base model and revision it was trained on, with the same target modules; "
        "check adapter_config.json's base_model_name_or_path and the peft version.",
    ),
    Fact(
        "Q",
        "How do I merge a LoRA adapter that was trained with QLoRA?",
        "Load the base in bf16 or fp16 (not 4-bit), apply the adapter and call merge_and_unload(); merging "
        "into 4-bit weights loses precision.",
    ),
    Fact(
        "Q",
        "I added new tokens to the tokenizer. What else must LoRA train?",
        "Resize the embeddings and list embed_tokens and lm_head in modules_to_save, otherwise the new tokens' "
        "rows stay random.",
    ),
    Fact(
        "T",
        "unsloth",
        "unsloth patches the model with faster kernels and a memory-saving gradient checkpointing for LoRA and "
        "QLoRA on CUDA; without CUDA use plain transformers and peft.",
    ),
    Fact(
        "T",
        "bf16 versus fp16",
        "bf16 has fp32's range, so it needs no loss scaling and rarely overflows; it needs Ampere or newer, "
        "which covers RTX 30, 40 and 50 cards. Use fp16 with a GradScaler only on older GPUs.",
    ),
    Fact(
        "T",
        "TF32 matmuls",
        "On Ampere and newer, torch.set_float32_matmul_precision('high') lets fp32 matmuls use TF32, which is "
        "much faster with little effect on fine-tuning quality.",
    ),
    # ---- DDP ----------------------------------------------------------------------------------------
    Fact(
        "T",
        "keeping settings identical on every rank",
        "LoRA rank, alpha, target modules, quantization, base model, sequence length, tokenizer and data recipe "
        "must be identical on every rank; DDP assumes identical trainable parameters.",
    ),
    Fact(
        "Q",
        "How should each rank pick its GPU under DDP?",
        "Call torch.cuda.set_device(local_rank) before init_process_group and wrap with "
        "DDP(model, device_ids=[local_rank]), where local_rank comes from LOCAL_RANK.",
    ),
    Fact(
        "S",
        "DDP raises 'Expected to mark a variable ready only once'",
        "Usually reentrant gradient checkpointing under DDP. Use non-reentrant checkpointing (use_reentrant=False) "
        "and keep find_unused_parameters=False.",
    ),
    Fact(
        "T",
        "find_unused_parameters in DDP",
        "Keep it False for LoRA: every adapter takes part in every forward. True costs an extra graph traversal "
        "each step and can clash with gradient checkpointing.",
    ),
    Fact(
        "Q",
        "How do I find which parameters DDP thinks are unused?",
        "Run with TORCH_DISTRIBUTED_DEBUG=DETAIL: DDP then names the parameters that got no gradient, usually "
        "an adapter on a module the forward never calls.",
    ),
    Fact(
        "T",
        "gradient accumulation under DDP",
        "Run every micro-batch but the last under model.no_sync(), so each rank synchronizes gradients exactly "
        "once per optimizer step.",
    ),
    Fact(
        "C",
        "ranks run a different number of synchronized backward passes per step",
        "DDP all-reduces on every synchronized backward, so ranks with different counts wait for each other "
        "forever. Do all extra micro-steps under no_sync() and exactly one synchronized backward per step.",
    ),
    Fact(
        "C",
        "DDP start-up takes half a minute on 1 Gbps Ethernet",
        "DDP broadcasts every parameter and buffer from rank 0 at construction, the frozen 4-bit base "
        "included (about 3.5 GB for 7B). Every rank loads the same base from disk, so exclude the frozen "
        "weights from that broadcast.",
    ),
    Fact(
        "C",
        "one rank finishes its data early and the others hang",
        "Make every rank run the same number of optimizer steps: split each global batch across ranks instead "
        "of giving ranks per-rank files of different lengths.",
    ),
    Fact(
        "C",
        "the 12 GB card waits for the 8 GB cards every step",
        "Plain DDP runs at the slowest rank's pace. Give each rank a share of the global batch in proportion to "
        "its measured throughput, within its memory, and weight the loss by tokens.",
    ),
    Fact(
        "T",
        "balancing two GPUs of different speeds in one job",
        "Split each global batch by measured throughput, capped by each GPU's memory profile, and re-plan when "
        "the measured step times drift.",
    ),
    Fact(
        "Q",
        "Which rank should save checkpoints and write logs?",
        "Rank 0 writes checkpoints and the main log; the other ranks wait at a barrier or the next collective, "
        "and each rank may still write its own small per-rank log.",
    ),
    Fact(
        "T",
        "the process group timeout",
        "Set it in init_process_group(timeout=...) long enough for the longest legitimate pause, such as rank 0 "
        "writing a checkpoint, and short enough that a dead rank ends the job instead of hanging it.",
    ),
    Fact(
        "S",
        "a watchdog reports an ALLREDUCE collective timeout",
        "One rank stopped joining collectives: it crashed, hangs, or is still busy, for example saving. Read "
        "every rank's log for the first error by time; raise the timeout only for a legitimate long pause.",
    ),
    Fact(
        "T",
        "training on CPU with gloo",
        "The gloo backend runs torch.distributed on CPU. It is slower than NCCL but runs the same code, which "
        "makes it good for tests on a laptop without a GPU.",
    ),
    # ---- loss, data, schedule --------------------------------------------------------------------
    Fact(
        "C",
        "ranks with smaller batches dominate the update",
        "Averaging per-rank mean losses over-weights small batches. Sum token losses on each rank, scale by "
        "world size over the global token count, and let DDP average: that is the gradient of the whole batch.",
    ),
    Fact(
        "Q",
        "What is the token-weighted loss for unequal per-rank batches?",
        "With T_r label tokens on rank r and T the sum over all W ranks (one scalar all-reduce), rank r "
        "backpropagates L_r = (W / T) * sum of its token losses; DDP's mean then equals the loss over the union "
        "batch.",
    ),
    Fact(
        "Q",
        "Why multiply the rank's loss by the world size in the token-weighted loss?",
        "DDP averages gradients over W ranks, dividing by W; multiplying by W first cancels that, so the result "
        "is the sum of all token losses divided by the global token count T.",
    ),
    Fact(
        "Q",
        "How should the logged loss be computed across ranks?",
        "All-reduce the summed token loss and the token count, then divide: the global token mean, comparable "
        "between runs with different batch splits.",
    ),
    Fact(
        "T",
        "packing sequences",
        "Packing concatenates tokenized examples into fixed-length blocks so no compute is spent on padding; "
        "every rank must pack the same data the same way.",
    ),
    Fact(
        "T",
        "training only on the answers",
        "Set the prompt tokens' labels to -100 so the loss covers only the response; padding is masked the same way.",
    ),
    Fact(
        "S",
        "the tokenizer has no pad token",
        "Llama tokenizers often lack one: set tokenizer.pad_token = tokenizer.eos_token or add a pad token, and "
        "mask padding out of the labels with -100.",
    ),
    Fact(
        "T",
        "picking the sequence length",
        "Choose it from the data's length distribution and the smallest card's memory, then use it on every "
        "rank; small cards fit it with a smaller micro-batch.",
    ),
    Fact(
        "T",
        "the global batch size",
        "The number of sequences in one optimizer step, summed over all ranks and micro-batches.",
    ),
    Fact(
        "T",
        "a warmup and cosine learning-rate schedule",
        "Raise the learning rate linearly over the first steps, then decay it along a cosine to a small floor; "
        "the scheduler's state belongs in every checkpoint.",
    ),
    Fact(
        "T",
        "gradient clipping",
        "Clip the global gradient norm, for example at 1.0, after gradients are synchronized and before the "
        "optimizer step; a non-finite norm means the step must be skipped or the run stopped.",
    ),
    Fact(
        "C",
        "the loss becomes NaN after a few hundred steps",
        "Keep the last good checkpoint, then lower the learning rate or lengthen the warmup, check that gradient "
        "clipping is on, and look for fp16 overflow; bf16 avoids most of it.",
    ),
    Fact(
        "C",
        "the loss is NaN from the very first step",
        "Check for batches whose labels are all -100 (zero tokens), a learning rate typo such as 1e2, and fp16 "
        "without loss scaling.",
    ),
    Fact(
        "Q",
        "How do I find where a NaN first appears?",
        "Check torch.isfinite on the loss and the gradient norm every step and stop at the first failure; "
        "torch.autograd.set_detect_anomaly(True) names the operation but slows training a lot.",
    ),
    Fact(
        "C",
        "the data loader is the bottleneck",
        "Tokenize and pack the data once before training, and raise the data-loader workers on the slow host; "
        "the worker count is a rank-local knob.",
    ),
    Fact(
        "C",
        "a seeded run is not reproducible",
        "Seed Python, torch and the data order on every rank, keep the data loader off the global generator, "
        "and restore every rank's RNG state on resume.",
    ),
    Fact(
        "C",
        "tokens per second drop over time",
        "Check nvidia-smi -q -d PERFORMANCE for thermal or power throttling, other processes on the GPU, and "
        "swapping on the host.",
    ),
    # ---- checkpoints and resume ---------------------------------------------------------------------
    Fact(
        "T",
        "the contents of a resumable checkpoint",
        "The adapter weights, optimizer and scheduler state, the step and sampler position, every rank's RNG "
        "state and a hash of the cluster-wide configuration.",
    ),
    Fact(
        "C",
        "a checkpoint was cut short when the machine lost power",
        "Write each checkpoint into a temporary directory, fsync, then rename it into place; on resume load the "
        "newest checkpoint whose manifest matches its files.",
    ),
    Fact(
        "T",
        "resuming without a shared filesystem",
        "Keep checkpoints on the rank-0 host; on resume rank 0 loads the checkpoint and broadcasts it to the "
        "other ranks, so no NFS is needed.",
    ),
    Fact(
        "C",
        "a resumed run's loss differs from an uninterrupted run",
        "Restore everything that drives order and randomness, not only the weights: optimizer, scheduler, "
        "sampler position and every rank's RNG state.",
    ),
    Fact(
        "C",
        "the loss spikes right after resuming",
        "Some state was not restored, usually the learning-rate scheduler (warmup restarts) or the optimizer's "
        "moments.",
    ),
    Fact(
        "Q",
        "Can I resume a run with a different LoRA rank?",
        "No: a checkpoint resumes only a job with the same cluster-wide settings. Compare the configuration "
        "hash stored in the checkpoint with the job's and refuse on a mismatch.",
    ),
    Fact(
        "Q",
        "Can I resume with a different number of GPUs?",
        "Yes: weights and optimizer state are the same on every rank, so they load anywhere; the batch split "
        "is planned again for the new ranks, keeping the global batch.",
    ),
    Fact(
        "T",
        "keeping only a few checkpoints",
        "Keep the last K checkpoints and delete older ones only after the new one is written and verified.",
    ),
    Fact(
        "S",
        "the disk fills up during checkpointing",
        "With write-then-rename the failed save leaves the previous checkpoint intact. Free space, keep fewer "
        "checkpoints, and resume from the last complete one.",
        BIG,
    ),
    # ---- disk, clock, host hygiene -------------------------------------------------------------------
    Fact(
        "S",
        "the disk is nearly full",
        "df -h shows where; the usual culprits are old checkpoints, the Hugging Face cache (du -sh "
        "~/.cache/huggingface) and journald logs (journalctl --vacuum-size=500M). Check free disk in preflight.",
    ),
    Fact(
        "C",
        "the clocks of the nodes disagree",
        "Run chrony or systemd-timesyncd on every node and check timedatectl shows the clock synchronized. "
        "Skewed clocks make logs impossible to line up and break TLS and apt.",
    ),
    Fact(
        "Q",
        "How do I check that a node's clock is synchronized?",
        "timedatectl status should say 'System clock synchronized: yes'; with chrony, chronyc tracking shows "
        "the offset.",
    ),
    Fact(
        "T",
        "reading the logs of a failed distributed run",
        "Collect every rank's log in one place and find the first error by time; later errors on other ranks "
        "are usually timeouts caused by it. Synchronized clocks make this possible.",
    ),
    Fact(
        "T",
        "where each rank's logs should go",
        "One log file per rank, named by host and rank, collected to the controller after the run.",
    ),
    Fact(
        "T",
        "TensorBoard for a run",
        "Point tensorboard --logdir at the run directory; rank 0 writes loss, learning rate and throughput.",
    ),
    Fact(
        "T",
        "following a job after closing the terminal",
        "Start the job detached so it survives the SSH session, and read its status and logs later instead of "
        "keeping a terminal open.",
    ),
    Fact(
        "C",
        "the same job was started twice by accident",
        "Record the job's process group on each host at launch, and refuse to start a job on a host where the "
        "recorded one is still alive.",
    ),
    Fact(
        "T",
        "stopping a job on every host",
        "Signal the process group recorded at launch on each host (SIGTERM first, SIGKILL after a grace "
        "period); torchrun forwards the signal to its workers.",
    ),
    Fact(
        "S",
        "a rank never joined the job",
        "Read that host's torchrun log: a missing Python environment, a wrong code directory, or a firewall "
        "blocking the rendezvous port are the usual causes.",
    ),
    Fact(
        "C",
        "the training code differs between nodes",
        "Sync the code and job file to every host from the controller and compare their hashes before starting.",
    ),
    Fact(
        "T",
        "Python environments on the nodes",
        "Build one virtual environment from one lock file on every node, so torch, transformers and peft "
        "versions match exactly.",
    ),
    Fact(
        "Q",
        "How do I install Python packages on nodes without internet access?",
        "Build a wheelhouse on the controller (pip wheel -r requirements.lock -w wheelhouse), copy it over, and "
        "install with pip install --no-index --find-links wheelhouse -r requirements.lock.",
    ),
    Fact(
        "T",
        "a preflight check before launch",
        "Check versions, name resolution, the rendezvous port, the ephemeral range, free disk, clock sync and "
        "a small all-reduce on every host before starting a long job.",
    ),
    Fact(
        "T",
        "choosing the rendezvous host",
        "Pick the host with a stable address and the most disk, usually the one with the largest GPU; it "
        "serves the rendezvous and stores the checkpoints.",
    ),
    # ---- Ansible ---------------------------------------------------------------------------------------
    Fact(
        "T",
        "the inventory of a three-box cluster",
        "List the three hosts in one group with ansible_host set to their cluster addresses, mark the "
        "rendezvous host, and keep ports and profiles in group_vars and host_vars.",
    ),
    Fact(
        "Q",
        "How do I check that Ansible reaches every node?",
        "ansible all -m ansible.builtin.ping; ansible-inventory --graph shows which hosts and groups the "
        "inventory defines.",
    ),
    Fact(
        "S",
        "Ansible reports the host UNREACHABLE",
        "Check that the host is up, that ansible_host is its correct address, and that ssh with the inventory's "
        "user and key works by hand.",
    ),
    Fact(
        "S",
        "SSH from the controller asks for a password",
        "Ansible needs key-based SSH: put the controller's public key in the node's authorized_keys with "
        "ssh-copy-id, and record its host key in known_hosts.",
    ),
    Fact(
        "C",
        "a playbook reports changes on every run",
        "A role must be idempotent: a second run should report changed=0. Find the task that reports a change "
        "and make it compare state before acting, for example creates: for commands.",
    ),
    Fact(
        "Q",
        "How do I preview what a playbook would change?",
        "ansible-playbook --check --diff runs in dry-run mode and prints file differences; tasks that cannot "
        "predict their result may be skipped.",
    ),
    Fact(
        "Q",
        "How do I run a playbook against one node only?",
        "Add --limit node3070 to ansible-playbook; the other hosts are left untouched.",
    ),
    Fact(
        "T",
        "group_vars versus host_vars",
        "group_vars hold cluster-wide values and host_vars per-host ones; host_vars win over group_vars, so "
        "validate that a host does not override a cluster-wide key.",
    ),
    Fact(
        "Q",
        "How do I reboot the nodes after a driver change without downing the whole cluster at once?",
        "Use the ansible.builtin.reboot module with serial: 1 in the play; it waits for each host to come back "
        "before moving on.",
    ),
    Fact(
        "T",
        "become in Ansible",
        "become: true runs tasks with sudo; installing packages, holding drivers and editing /etc/hosts need "
        "it, while launching the job can run as the training user.",
    ),
    Fact(
        "T",
        "handlers in Ansible",
        "A task notifies a handler, which runs once at the end of the play and only if something changed, for "
        "example reloading the firewall after its rules file changed.",
    ),
    Fact(
        "Q",
        "How can Ansible render /etc/hosts for the cluster?",
        "Loop over the cluster group in a template or with ansible.builtin.blockinfile, writing each host's "
        "cluster address and name, so every node resolves every other node.",
    ),
    Fact(
        "T",
        "ansible-lint and Molecule",
        "ansible-lint checks roles against best practices; Molecule runs a role on test hosts, runs it again to "
        "check idempotence, and verifies the resulting state.",
    ),
    Fact(
        "T",
        "the controller machine",
        "The controller runs Ansible and follows the job; it can be one of the training nodes or a laptop on the "
        "same network.",
    ),
]

EXAMPLES: list[Example] = [
    Example(
        "Here is an error from master. What does it mean and how do I fix it?",
        "NVIDIA GeForce RTX 5070 Ti with CUDA capability sm_120 is not compatible with the current PyTorch "
        "installation.",
        "The installed torch wheel has no kernels for Blackwell. Install a build for CUDA 12.8 or newer (the "
        "cu128 wheels) and make sure the host runs a 570 or newer open driver.",
    ),
    Example(
        "This appears on node3070 when I run nvidia-smi. What happened?",
        "Failed to initialize NVML: Driver/library version mismatch",
        "The driver libraries were upgraded but the old kernel module is still loaded. Reboot, then hold all "
        "packages of the driver branch so unattended upgrades cannot do it again.",
    ),
    Example(
        "node3070 crashed with this. Which settings should I change?",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total "
        "capacity of 7.63 GiB of which 112.00 MiB is free.",
        "Change only that host's rank-local knobs: lower its micro-batch size and enable gradient "
        "checkpointing in its memory profile. Keep the sequence length and LoRA settings as they are.",
    ),
    Example(
        "node4070 logs this at start-up. What is wrong?",
        "torch.distributed.DistNetworkError: The client socket has timed out after 900s while trying to "
        "connect to (master, 29500).",
        "node4070 cannot reach the rendezvous on master: check getent hosts master on node4070, nc -zv master "
        "29500, and that master's firewall allows the cluster subnet on 29500.",
    ),
    Example(
        "The rendezvous worked, then NCCL logged this on node3070. What should I change?",
        "NCCL WARN socketStartConnect: Connect to 192.168.1.10<45213> failed : No route to host",
        "45213 is an ephemeral port, so a firewall drops NCCL's own connections. Allow the ephemeral range "
        "from the cluster subnet on every node, not only port 29500.",
    ),
    Example(
        "What does this line from NCCL_DEBUG=INFO on node4070 tell me?",
        "NCCL INFO NET/Socket : Using [0]docker0:172.17.0.1<0>",
        "NCCL chose the Docker bridge, which other hosts cannot reach. Set NCCL_SOCKET_IFNAME on node4070 to "
        "the interface that holds its cluster address, or exclude docker0 with ^docker0,lo.",
    ),
    Example(
        "torchrun fails on node3070 with this. How do I fix it?",
        "socket.gaierror: [Errno -3] Temporary failure in name resolution",
        "node3070 cannot resolve a cluster host's name, often the FQDN that c10d advertises for rank 0. "
        "Render /etc/hosts with every node's name and address, or pass --local-addr.",
    ),
    Example(
        "I see this warning on master when torchrun starts. Does it matter?",
        "[c10d] The client socket cannot be initialized to connect to [master]:29500 (errno: 97 - Address "
        "family not supported by protocol).",
        "The name resolved to an IPv6 address the socket could not use. Map the cluster names to their IPv4 "
        "addresses in /etc/hosts so every node uses one address family.",
    ),
    Example(
        "Training with gradient checkpointing under DDP fails with this. What is the fix?",
        "RuntimeError: Expected to mark a variable ready only once.",
        "Reentrant checkpointing makes DDP see a parameter's gradient hook fire more than once. Enable "
        "checkpointing with "
        "gradient_checkpointing_kwargs={'use_reentrant': False} and keep find_unused_parameters=False.",
    ),
    Example(
        "I get this warning and LoRA does not learn. Why?",
        "UserWarning: None of the inputs have requires_grad=True. Gradients will be None",
        "Reentrant checkpointing with a frozen embedding passes no gradient to the adapters. Use non-reentrant "
        "checkpointing, or call model.enable_input_require_grads().",
    ),
    Example(
        "The job died after ten minutes with this on node4070. Where do I look?",
        "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE) ran for 600000 "
        "milliseconds before timing out.",
        "Another rank stopped joining collectives. Read every rank's log for the earliest error, often an OOM "
        "or crash on one host; this timeout is a consequence, not the cause.",
    ),
    Example(
        "apt update on node3070 prints this. What is wrong?",
        "E: Release file for http://archive.ubuntu.com/ubuntu/dists/noble-updates/InRelease is not valid yet "
        "(invalid for another 2h 13min 5s).",
        "node3070's clock is behind. Enable time synchronization (chrony or systemd-timesyncd) on every node "
        "and check timedatectl shows the clock synchronized.",
    ),
    Example(
        "Saving a checkpoint on master failed with this. Is the run lost?",
        "OSError: [Errno 28] No space left on device",
        "No, if checkpoints are written to a temporary directory and renamed: the previous one is intact. "
        "Free space, keep fewer checkpoints, and resume from the last complete one.",
    ),
    Example(
        "Ansible prints this for node4070. What should I check?",
        "node4070 | UNREACHABLE! => Failed to connect to the host via ssh: Permission denied (publickey,password).",
        "SSH reaches node4070 but refuses the key. Install the controller's public key for the inventory's "
        "ansible_user (ssh-copy-id) and test ssh by hand.",
    ),
    Example(
        "Is anything wrong in this environment file for the cluster?",
        "NCCL_SOCKET_IFNAME=eno1\nNCCL_TREE_THRESHOLD=0\nNCCL_TIMEOUT=1800",
        "Drop NCCL_TREE_THRESHOLD (no effect since NCCL 2.5) and NCCL_TIMEOUT (not an NCCL variable; use the "
        "process group timeout). Render NCCL_SOCKET_IFNAME per host, since not every host has eno1.",
    ),
    Example(
        "Is this host_vars file for node3070 valid?",
        "micro_batch_size: 1\ngradient_checkpointing: true\nseq_len: 512",
        "The first two are rank-local and fine. seq_len is cluster-wide: remove it and keep node3070's "
        "memory down with the micro-batch size and checkpointing instead.",
    ),
    Example(
        "Can I load the base model like this for DDP on master?",
        'model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb, device_map="auto")',
        "Use device_map={\"\": local_rank} instead: 'auto' may split the model across GPUs, which turns DDP "
        "into model parallelism. Each rank must hold a whole copy on its own GPU.",
    ),
    Example(
        "Our stop script does this on each host. Is it OK?",
        "ssh $host pkill --full torchrun",
        "No: it kills every process whose command line mentions torchrun, including other jobs. Record the "
        "job's process group at launch and signal only that group.",
    ),
]


PHRASINGS = 2  # of the three templates per kind; fact i uses templates i and i+1 (mod 3)


def build() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(training rows, held-out rows)."""
    rows: list[dict[str, str]] = []
    held_out: list[dict[str, str]] = []
    for i, fact in enumerate(FACTS):
        for j in range(PHRASINGS):
            template = TEMPLATES[fact.kind][(i + j) % 3]
            host = fact.hosts[(i // 3 + j) % len(fact.hosts)]
            row = {"instruction": template.format(topic=fact.topic, host=host), "output": fact.answer}
            (held_out if j == 1 and i % EVAL_EVERY == 0 else rows).append(row)
    for ex in EXAMPLES:
        rows.append({"instruction": ex.instruction, "input": ex.input, "output": ex.output})
    return rows, held_out


def check(rows: list[dict[str, str]]) -> None:
    seen: set[tuple[str, str, str]] = set()
    for n, row in enumerate(rows, 1):
        for key in ("instruction", "output"):
            if not row.get(key, "").strip():
                raise SystemExit(f"row {n}: empty {key}")
        pair = (row["instruction"], row.get("input", ""), row["output"])
        if pair in seen:
            raise SystemExit(f"row {n}: duplicate pair {row['instruction']!r}")
        seen.add(pair)
    if not 300 <= len(rows) <= 400:
        raise SystemExit(f"{len(rows)} rows, expected 300 to 400")


def main() -> None:
    rows, held_out = build()
    check(rows + held_out)
    trained = {row["instruction"] for row in rows}
    if any(row["instruction"] in trained for row in held_out):
        raise SystemExit("a held-out question is also a training question")
    for path, part in ((TRAIN, rows), (EVAL, held_out)):
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in part)
        path.write_text(text, encoding="utf-8")
        sys.stdout.write(f"wrote {path}: {len(part)} pairs, {len(text.encode())} bytes\n")
    sys.stdout.write(f"from {len(FACTS)} facts and {len(EXAMPLES)} examples\n")


if __name__ == "__main__":
    main()
