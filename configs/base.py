"""Every default of tunixlike lives here. Other configs start from `base.get_config()` and change keys.

Run: python -m tunixlike.train --config configs/addition_grpo.py --workdir runs/addition
Override any key: --config.rl.max_staleness=2 ; variants: --config configs/x.py:size=tiny
"""

import ml_collections
from ml_collections.config_dict import placeholder


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  c = ml_collections.ConfigDict()
  c.seed = 0  # model init, sampling noise and data order all derive from it

  # Model: either a local Hugging Face directory (hf_path) or a fresh random model of these sizes.
  c.model = m = ml_collections.ConfigDict()
  m.hf_path = placeholder(str)  # local HF checkpoint dir; when set, the sizes below are ignored
  m.teacher_path = placeholder(str)  # on-policy distillation (algo.advantage="distill"): frozen teacher's HF dir
  m.critic_path = placeholder(str)  # PPO: HF dir of a separate critic model (same vocab); None = head on the policy trunk
  m.hidden_size = 64  # tiny defaults: the built-in tasks learn on a CPU in minutes
  m.num_layers = 2  # two layers suffice for reversed-digit addition
  m.num_heads = 4  # query heads
  m.num_kv_heads = 2  # GQA: key/value heads (must divide num_heads)
  m.head_dim = 16  # per-head width
  m.intermediate_size = 256  # SwiGLU width (4x hidden)
  m.rope_theta = 10000.0  # RoPE base; short sequences need no more
  m.rms_norm_eps = 1e-6  # as in Qwen2 / Llama 3
  m.qkv_bias = False  # Qwen2-style biases on q/k/v projections
  m.qk_norm = False  # Qwen3-style RMSNorm on queries and keys
  m.tie_embeddings = True  # share input embedding and output projection (fewer params)
  m.param_dtype = "float32"  # master weights
  m.dtype = "float32"  # compute dtype ("bfloat16" on TPU/GPU)
  m.remat = False  # recompute activations in the backward pass to save memory

  # Device split: sampler devices decode, learner devices train (per host with several hosts).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.sampler_devices = 4  # devices that decode (4 + 4 of 8 virtual CPU devices)
  c.mesh.learner_devices = 4  # devices that train (fsdp x tensor)
  c.mesh.sampler_tensor = 1  # tensor parallelism hurts on CPU; use it on TPU/GPU for big models
  c.mesh.learner_tensor = 1  # tensor-parallel degree of the learner; the rest is FSDP

  # Data: a built-in task or a local dataset.
  c.data = d = ml_collections.ConfigDict()
  d.task = "addition"  # built-in task: addition | reverse | gsm8k
  d.path = placeholder(str)  # gsm8k: a directory with train.jsonl and test.jsonl (None: the copy shipped with tunixlike)
  d.digits = 3  # addition: operand digits (difficulty)
  d.max_prompt_length = 64  # longer prompts are filtered out and counted
  d.shuffle_seed = 0  # order of the training prompts (reshuffled every epoch)
  d.num_eval_examples = 500  # held-out accuracy swings 10-15 points on small evals

  # Sampler (JetStream-style engine over decode slots).
  c.sampler = s = ml_collections.ConfigDict()
  s.max_concurrent_decodes = 128  # decode slots, shared by all replicas
  s.max_prefill_length = 64  # longest prompt; prefill compiles once per power-of-two bucket
  s.max_new_tokens = 8  # completion length limit (finish_reason "length")
  s.temperature = 1.0  # 0 = greedy; the learner scores tokens at the same temperature
  s.top_k = 0  # 0 = off
  s.top_p = 1.0  # 1 = off; with < 1 consider algo.keep_sampling_mask
  s.steps_per_call = 4  # decode steps per host round-trip (stop conditions stay exact)
  s.record_sampling_mask = False  # "Keep Sampling Mask" payload
  s.record_routing = False  # "Keep Routing" payload: the experts each MoE layer chose (MoE models only)
  s.stop_strings = ()  # completions also end at these strings (checked on the host)
  s.attend_bucket = 32  # decode attends the filled cache rounded up to this many positions
  s.slot_groups = 1  # slot groups with their own attention windows (2: long sequences kept together)
  s.warmup = False  # compile every decode program before the run (no mid-run compile stalls; costs start-up)

  # Algorithm: GRPO family.
  c.algo = a = ml_collections.ConfigDict()
  a.group_size = 8  # G samples per prompt
  a.advantage = "grpo"  # grpo | dr_grpo | rloo
  a.loss = "ppo_clip"  # ppo_clip | dapo | gspo
  # None = the loss's paper default (ppo_clip: token_mean, eps 0.2/0.2; dapo: eps 0.2/0.28).
  a.aggregation = placeholder(str)  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
  a.eps_low = placeholder(float)  # lower clip of the ratio (None = the loss's default)
  a.eps_high = placeholder(float)  # upper clip; DAPO clip-higher uses 0.28
  a.norm_length = 0  # constant L of seq_mean_token_sum_norm (Dr. GRPO: the max completion length)
  a.decoupled = True  # trust region around the learner's proximal policy, IS-correct the sampler
  a.kl_coef = 0.0  # KL to the reference; 0 skips the reference forward
  a.kl_estimator = "k3"  # k1 | k2 | k3
  a.is_mode = "tis"  # off-policy correction: none | tis (truncate) | mis (icepop mask)
  a.is_level = "token"  # token | sequence
  a.is_cap = 2.0  # TIS cap (verl default)
  a.is_low = 0.5  # MIS band
  a.is_high = 2.0  # MIS band upper edge: tokens outside [is_low, is_high] are masked
  a.dynamic_sampling = False  # DAPO: drop zero-variance groups and refill
  # "Keep Sampling Mask" (needs sampler.record_sampling_mask): the IS ratio is exactly 1 at staleness 0.
  a.keep_sampling_mask = False  # renormalise over the sampler's recorded top-k/top-p set
  # "Keep Routing" (needs sampler.record_routing): MoE experts that would flip cannot move the IS ratio.
  a.keep_routing = False  # force the sampler's recorded experts in the learner's forward (routing replay)
  a.overlong_buffer = 0  # DAPO soft overlong penalty over the last N tokens before max_new_tokens; 0 = off
  a.overlong_penalty = 1.0  # the penalty at max_new_tokens (linear over the buffer)
  # Process rewards: a registered PRM scores each step's prefix while the completion still decodes.
  a.process_reward = placeholder(str)  # name of a registered process reward (rewards/process.py); None = off
  a.process_reward_coef = 1.0  # weight of the process-supervised per-token advantage next to the outcome one
  a.step_delimiter = "\n"  # a token completing this string ends a step ("" = off)
  a.step_every_tokens = 0  # also end a step every N tokens (0 = off)
  # PPO with a learned critic (algo.estimator="ppo"): per-token GAE advantages instead of group baselines.
  a.estimator = "grpo_family"  # grpo_family (algo.advantage from group rewards) | ppo (critic + GAE)
  a.gamma = 1.0  # PPO discount inside a completion; 1 = the end reward counts fully at every token
  a.gae_lambda = 0.95  # PPO GAE bias/variance trade-off (1 = Monte Carlo returns, 0 = one-step TD)
  a.vf_coef = 0.5  # PPO weight of the value loss next to the policy loss
  a.vf_clip = 0.2  # PPO value clipping around the pre-update values; 0 = off
  a.kl_reward_coef = 0.0  # PPO token-level KL-to-reference penalty folded into the rewards; 0 = off
  a.whiten_advantages = True  # PPO: normalise the GAE advantages over the batch's tokens

  # Optimizer.
  c.optim = o = ml_collections.ConfigDict()
  o.learning_rate = 5e-4  # 1e-3 collapsed in probes of the addition task
  o.warmup_steps = 0  # linear warm-up of the learning rate
  o.schedule = "constant"  # constant | cosine
  o.grad_clip = 1.0  # global-norm clip; 0 = off
  o.weight_decay = 0.0  # AdamW decay; RL moves little, none needed by default
  o.b1 = 0.9  # Adam first-moment decay
  o.b2 = 0.99  # faster than 0.999: RL gradients are non-stationary
  o.micro_batches = 1  # exact token-weighted gradient accumulation
  o.group_by_length = 0  # N > 0: rows sorted by length, micro-batches trimmed to T*k/N (long tails)

  # Learner memory: components kept in host memory between steps and streamed in for each step.
  c.learner = ln = ml_collections.ConfigDict()
  ln.offload = ()  # any of "reference", "optimizer", "critic" (the separate model of model.critic_path)

  # LoRA (rank 0 = full fine-tuning).
  c.lora = l = ml_collections.ConfigDict()
  l.rank = 0  # adapter rank; 0 trains all weights
  l.alpha = 16.0  # adapter scale is alpha / rank
  l.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # projections to adapt

  # Async runtime.
  c.rl = r = ml_collections.ConfigDict()
  r.num_steps = 60  # learner steps (= policy versions) of RL
  r.prompts_per_step = 32  # groups per learner step
  r.max_staleness = 1  # 0 = synchronous (the baseline every comparison uses)
  r.sync_mode = "soft_pause"  # soft_pause (swap between decode steps) | drain
  r.sync_dtype = placeholder(str)  # e.g. "bfloat16" for a bf16 sampler
  r.reward_workers = 4  # threads scoring groups, so slow verifiers never stall decoding
  r.reward_timeout_s = 10.0  # a reward call slower than this scores 0 and is counted
  r.max_nonfinite_steps = 3  # stop after this many non-finite losses in a row
  r.wait_timeout_s = 300.0  # no wait without a timeout
  r.stop_on_collapse = True  # stop at a collapsed step (the best checkpoint survives) rather than train on
  r.collapse_entropy_frac = 0.01  # collapsed: token entropy within this fraction of ln V (uniform policy)
  r.collapse_spike_factor = 1000.0  # also collapsed: grad norm this many times its recent median (0 = off)
  # Multi-turn: episodes interleave decoding with environment steps (tool calls) in a thread pool.
  r.env = placeholder(str)  # "calculator" = the built-in tool environment; None = single-turn
  r.env_max_turns = 4  # policy turns per episode
  r.env_step_timeout_s = 30.0  # a tool slower than this costs its episode, not the run

  # Supervised warm start before RL (stops once held-out accuracy reaches the target).
  c.warm_start = w = ml_collections.ConfigDict()
  w.max_steps = 0  # 0 = no warm start
  w.batch_size = 64  # (prompt, answer) pairs per supervised step
  w.learning_rate = 1e-3  # supervised steps tolerate a larger rate than RL
  w.target_accuracy = 0.2  # a warm start that memorises stops exploring: stop early
  w.eval_every = 25  # check held-out accuracy this often (teacher-forced, cheap)

  c.eval = e = ml_collections.ConfigDict()
  e.every_steps = 0  # 0 = only before and after RL

  c.log = g = ml_collections.ConfigDict()
  g.tensorboard = True  # WORKDIR/tensorboard event files
  g.progress_bar = True  # console progress bar (off in tests and notebooks)
  g.trace = False  # write WORKDIR/trace.json (Chrome / Perfetto) of sampler, learner, sync, reward spans

  # Several hosts (multi-controller JAX). Unset keys fall back to JAX_COORDINATOR_ADDRESS,
  # JAX_NUM_PROCESSES, JAX_PROCESS_ID; with none of them set the run is single-process.
  c.distributed = dd = ml_collections.ConfigDict()
  dd.coordinator_address = placeholder(str)  # host:port of process 0, reachable from every host
  dd.num_processes = placeholder(int)  # hosts taking part
  dd.process_id = placeholder(int)  # this host's index, 0 .. num_processes - 1
  dd.auto_detect = False  # Cloud TPU pod slices, SLURM, Open MPI: let JAX find the cluster itself
  dd.timeout_s = 300  # wait this long for every process to connect

  c.checkpoint = k = ml_collections.ConfigDict()
  k.every_steps = 50  # also saved at step 0, at evals, at the end, on SIGTERM / Ctrl-C and on a crash
  k.every_seconds = 0.0  # 0 = off; e.g. 600 on preemptible TPU VMs
  k.keep = 2  # latest checkpoints kept, plus the one with the best held-out accuracy
  return c
