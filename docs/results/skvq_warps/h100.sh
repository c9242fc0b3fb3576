# Session 19 (issue 26): the Gluon SKVQ kernel at 2 warps a program (MMKV_SKVQ_WARPS=2, 64-token tiles) against 4.
# One H100 call: the GPU tests at 2 warps, the attention call replayed alone (InternVL / SmolLM2 heads, B1/B16,
# n4096/32768), then batch 1 inside the decode step of random:internvl2.5-8b at 32k.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
MMKV_SKVQ_WARPS=2 timeout 150 python3 -m pytest -q -m gpu -n 4 tests/test_skvq_gluon.py tests/test_skvq_split.py 2>&1 | tail -3
timeout 150 python3 -m eval.bench.skvq_attention --shapes internvl2.5-8b,smollm2-135m --tokens 4096,32768 \
  --batches 1,16 --groups 64 --variants var --graphs --ab "w4:MMKV_SKVQ_WARPS=4,w2:MMKV_SKVQ_WARPS=2" \
  --out $OUT/call_warps.json 2>&1 | grep -E "sdpa|K2V1.5|Error|error" | grep -v -i warn
timeout 200 python3 -m eval.studies.step_kernels --context 32768 --batch 1 --base-variants \
  --spec "text=skvq:k_bits=2,v_bits=1.5,group=64" --rounds 6 \
  --variants "w4:,w2:MMKV_SKVQ_WARPS=2,w4b:,w2b:MMKV_SKVQ_WARPS=2" --out $OUT/step_skvq_b1_warps.json 2>&1 \
  | grep -E "^## |^\| _skvq_kernel|^\| _segment_kernel|^\| _merge|Error|error" | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
