# Session 16 (issue 26): the one-kernel decode append (kernels/ops/append.py) on the GPU: its tests compiled, then
# decode steps of random:internvl2.5-8b at 32k with it (default) and without (MMKV_APPEND_KERNEL=0), alternating,
# in one process (docs/results/bisect_b16/step_kernels.py: median step, and the small kernels inside it).
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
timeout 120 python3 -m pytest -q tests/test_kernels.py -k "append" 2>&1 | tail -2
A="text=kivi:bits=2|1|32768"; F="fp16|1|32768"; C="text=kivi:bits=2|16|32768"
timeout 300 python3 docs/results/bisect_b16/step_kernels.py "$A|MMKV_APPEND_KERNEL=1" "$A|MMKV_APPEND_KERNEL=0" \
  "$F|MMKV_APPEND_KERNEL=1" "$F|MMKV_APPEND_KERNEL=0" "$A|MMKV_APPEND_KERNEL=1" "$A|MMKV_APPEND_KERNEL=0" \
  "$F|MMKV_APPEND_KERNEL=1" "$F|MMKV_APPEND_KERNEL=0" "$C|MMKV_APPEND_KERNEL=1" "$C|MMKV_APPEND_KERNEL=0" 2>&1 | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
