# demo-llava's packed training step (the shipped mix, position rows, batch 48) with FlexAttention over the rows'
# block mask against cuDNN SDPA over the dense 4D mask, one after the other on one H100; the same stream and init, so
# the first losses must agree. Writes the faster choice to /root/attn for the training call that follows
# (docs/results/demo_internvl_aux/train.sh reads ATTN); flex must be >= 5% faster and start on the same losses.
export PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  TORCHINDUCTOR_CACHE_DIR=/root/ind HF_HUB_OFFLINE=1
R=$OUT/res; mkdir -p $R
for A in flex sdpa; do
  timeout 270 python3 -m eval.train.step_profile --model demo-llava --pack --positions \
    --mix scene=0.4,text=0.15,document=0.3,chart=0.15 --batch 48 --workers 14 --warmup 20 --steps 20 --kernels 3 \
    --attention $A --out $R/prof_$A.json > $R/prof_$A.log 2>&1
  echo "$A rc=$?"; tail -4 $R/prof_$A.log | cut -c1-200
done
python3 - <<'PY'
import json, os
R = os.environ["OUT"] + "/res"
p = {}
for a in ("flex", "sdpa"):
    try:
        p[a] = json.load(open(f"{R}/prof_{a}.json"))
    except OSError:
        print(a, "no result")
for a, d in p.items():
    print(a, "rows/s %.1f ms/step %.1f warmup %.0f s" % (d["free"]["rows_per_s"], d["free"]["ms_per_step"],
          d["warmup_s"]), "first losses", d["first_losses"], "sections", d["sections_ms"])
pick = "sdpa"
if len(p) == 2:
    f, s = p["flex"], p["sdpa"]
    same = all(abs(x - y) <= 0.02 * abs(y) + 1e-3 for x, y in zip(f["first_losses"], s["first_losses"]))
    if same and f["free"]["rows_per_s"] >= 1.05 * s["free"]["rows_per_s"]:
        pick = "flex"
    print("losses agree:", same, "flex/sdpa rows/s %.3f" % (f["free"]["rows_per_s"] / s["free"]["rows_per_s"]))
open("/root/attn", "w").write(pick)
print("picked", pick)
PY
for A in flex sdpa; do grep -A14 "Self CUDA" $R/prof_$A.log | head -14 | cut -c1-160; done
tar -czf $OUT/flex_profile.tar.gz -C $OUT res && rm -r $OUT/res
