# Session 17 (issue 26): the Gluon text kernel's switches swept INSIDE the decode step (graph replays, torch's
# profiler; eval.studies.step_kernels, variants interleaved round by round), one H100:
#  0. the GPU tests of the whole-wave plan (B4 n32768 now 3 waves) and of the append kernel's final form;
#  1. XQuant 1.375 B16 n32768 (2x missed by 3.5% on the H200): waves 2/3/4/5, L2 prefetch 0/1/2, 2 warps, early merge;
#  2. KIVI-2 B1 n32768 (1.1x missed): prefetch 0/1/2/3, tiles per split, 4 warps.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 150 python3 -m pytest -q -m gpu tests/test_text_gluon.py -k "waves or long_context" 2>&1 | tail -2
timeout 120 python3 -m pytest -q tests/test_kernels.py -k append 2>&1 | tail -2
S="python3 -m eval.studies.step_kernels --context 32768 --base-variants"
X="text=xquant:kq=30,vq=2,km=32,vm=16"
timeout 230 $S --batch 16 --spec "$X" --rounds 8 --out $OUT/xquant_b16.json --variants \
  "now:,w2:MMKV_TEXT_WAVES=2,w4:MMKV_TEXT_WAVES=4,w5:MMKV_TEXT_WAVES=5,pf0:MMKV_TEXT_PREFETCH=0,pf2:MMKV_TEXT_PREFETCH=2,warps2:MMKV_TEXT_WARPS=2,pdl1:MMKV_TEXT_PDL=1" \
  2>&1 | grep -E "^## |^\| _text_kernel|^\| _segment_kernel|^\| _merge_kernel|Error|error" | grep -v -i warn
timeout 170 $S --batch 1 --spec "text=kivi:bits=2" --rounds 16 --out $OUT/kivi2_b1.json --variants \
  "now:,pf0:MMKV_TEXT_PREFETCH=0,pf2:MMKV_TEXT_PREFETCH=2,pf3:MMKV_TEXT_PREFETCH=3,tps4:MMKV_TEXT_TPS=4,tps9:MMKV_TEXT_TPS=9,warps4:MMKV_TEXT_WARPS=4" \
  2>&1 | grep -E "^## |^\| _text_kernel|^\| _segment_kernel|^\| _merge_kernel|Error|error" | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
