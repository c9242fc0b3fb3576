# Session 17 (issue 26): the fp16 window's splits (window_rules.window_tps, MMKV_WINDOW_TPS) inside the decode step on an
# H200 (fp16 at B16 n32768 does not fit an H100): mmkv fp16 and XQuant 1.375 at B16 and B1, the cap of 2 tiles a
# split (default) against the byte rule (0) and 1 tile, variants interleaved round by round (eval.studies.step_kernels).
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
timeout 60 python3 -m pytest -q tests/test_window_split.py 2>&1 | tail -1
S="python3 -m eval.studies.step_kernels --context 32768 --base-variants --spec fp16 --spec text=xquant:kq=30,vq=2,km=32,vm=16"
V="now:,wt0:MMKV_WINDOW_TPS=0,wt1:MMKV_WINDOW_TPS=1"
F="^## |^\| _text_kernel|^\| _segment_kernel|^\| _merge_kernel|Error|error"
timeout 300 $S --batch 16 --rounds 8 --variants "$V" --out $OUT/window_b16.json 2>&1 | grep -E "$F" | grep -v -i warn
timeout 150 $S --batch 1 --rounds 16 --variants "$V" --out $OUT/window_b1.json 2>&1 | grep -E "$F" | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
