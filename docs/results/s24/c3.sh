# Session 24 (issue 28), the end of call 2 (or a third call): finish either run if it was stopped, then score both
# towers on the model card's held-out sets (seed 1000) in fp16: short answers and documents (--n 400: ~250 scene
# questions, a 95% interval of about +-6 points on the scene score), clips (--n 80).
set -e
source docs/results/s24/env.sh
R=$OUT/res; mkdir -p $R
for L in 4 6; do [ -f /root/runs/iv$L/tower.safetensors ] || NEED=1; done
[ -z "$NEED" ] || bash docs/results/s24/train.sh 8
for L in 4 6; do
  T=/root/runs/iv$L
  python3 -m eval.studies.demo_quality --model demo-internvl --tower $T --n 400 --tasks vqa,doc --spec fp16 \
    --device cuda --out $R/iv${L}_dq.json > $R/iv${L}_dq.log 2>&1 &
  python3 -m eval.studies.demo_quality --model demo-internvl --tower $T --n 80 --tasks video --spec fp16 \
    --device cuda --out $R/iv${L}_dqv.json > $R/iv${L}_dqv.log 2>&1 &
done
wait
for L in 4 6; do cp /root/runs/iv$L/log.json $R/log_$L.json; cp /root/runs/iv$L/tower.json $R/tower_$L.json; done
tar -czf $OUT/eval.tar.gz -C $OUT res
# the study's own log ends with its headline lines and tables (scene exact among the short-answer categories)
for f in $R/iv*_dq*.log; do echo "== $f"; grep -v "^Loading" $f | tail -n 30; done
