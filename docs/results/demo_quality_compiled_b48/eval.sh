if [ ! -f /root/mmkvcache/ok ] || [ ! -f /root/runs/demo-internvl/tower.safetensors ]; then echo "MACHINE RECYCLED"; exit 3; fi
cd wip_tw
export PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
for m in llava internvl; do
  T=/root/runs/demo-$m
  python3 -m eval.studies.demo_quality --model demo-$m --tower $T --n 200 --tasks vqa,doc --device cuda --out $OUT/dq_$m.json > /root/dq_$m.log 2>&1 &
  python3 -m eval.studies.demo_quality --model demo-$m --tower $T --n 100 --tasks caption --device cuda --out $OUT/dqc_$m.json > /root/dqc_$m.log 2>&1 &
  python3 -m eval.studies.demo_quality --model demo-$m --tower $T --n 80 --tasks video --device cuda --out $OUT/dqv_$m.json > /root/dqv_$m.log 2>&1 &
done
wait
tail -n 3 /root/*.log
