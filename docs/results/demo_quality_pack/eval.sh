# The second call's evaluation of both packed towers (after train.sh finished their plans): the model card's
# held-out sets (seed 1000) under every spec of demo_quality's SPECS, tasks in parallel processes.
R=$OUT/res; mkdir -p $R
for m in ${MODELS:-llava internvl}; do
  T=/root/runs/$m
  [ -f $T/tower.safetensors ] || { echo "no tower $m"; continue; }
  tar -cf $OUT/tower_$m.tar -C $T tower.safetensors tower.json log.json
  python3 -m eval.studies.demo_quality --model demo-$m --tower $T --n 200 --tasks vqa,doc --device cuda \
    --out $R/${m}_dq.json > $R/${m}_dq.log 2>&1 &
  python3 -m eval.studies.demo_quality --model demo-$m --tower $T --n 80 --tasks video --device cuda \
    --out $R/${m}_dqv.json > $R/${m}_dqv.log 2>&1 &
  python3 -m eval.studies.demo_quality --model demo-$m --tower $T --n 100 --tasks caption --device cuda \
    --out $R/${m}_dqc.json > $R/${m}_dqc.log 2>&1 &
done
wait
[ -n "$NO_SUMMARY" ] && exit 0
tar -czf $OUT/results.tar.gz -C $OUT res
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/res/*.json")):
    d = json.load(open(f))
    for task, by in d["tasks"].items():
        for spec, r in by.items():
            m = r["metrics"]
            keys = [k for k in m if k in ("exact", "normalized", "ANLS", "CIDEr") or k.endswith(" exact")]
            print(os.path.basename(f), task, spec[:40], {k: round(m[k], 3) for k in keys if isinstance(m[k], float)})
PY
