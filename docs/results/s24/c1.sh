# Session 24 (issue 28), call 1 of 2 on one warm H100: the first half of SmolLM2's GGUF, its sha256 and the gguf wheel
# go to /root/sp (the GGUF, 98 MB, is over one call's 64 MiB; the device copy of the tree left out the shipped towers
# and docs/results, which these runs do not read, so that each half fits beside it).
set -e
mkdir -p /root/sp
cp wip_lead/gg/p0 wip_lead/gg/sha wip_lead/gg/gguf-*.whl /root/sp/
ls -l /root/sp
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
nproc
# an H200 (fp16 at batch 16 and 32k tokens does not fit an H100): the batch-16 decode-step ratios first (issue 26)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  mkdir -p wip_lead && ln -sfn $PWD/wip_lead/devcache wip_lead/mmkvcache
  bash docs/results/window_overlap/h200.sh 16 2 520 2>&1 | tee $OUT/h200_b16.txt
fi
