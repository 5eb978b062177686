"""What ``vlmfeed bench decode`` shows of its report: a table with the goal ratios and the paired
CPU-time figures, and a plot of images/s per contender against the goals with our path by stage."""
from __future__ import annotations

from datasvc.tools.bench.decode import GOAL_PATH


def plot_decode(rep: dict, path: str) -> None:
    """Images/s per contender against the goals, and where our path's time goes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"a": "tab:gray", "a+": "tab:brown", "b": "tab:orange", "c": "tab:green", "c-": "tab:olive",
               "r": "tab:purple"}
    names = list(rep["results"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2.2, 1]})
    ax.barh(names, [rep["results"][n]["images_per_s"] for n in names],
            color=[colours.get(rep["results"][n]["group"], "tab:blue") for n in names])
    ax.invert_yaxis()
    goals = rep["goals"]
    fastest_a = rep["results"][rep["fastest_decode"]]["images_per_s"]
    fastest_b = rep["results"][rep["fastest_hf"]]["images_per_s"]
    ax.axvline(goals["vs_fastest_decode"] * fastest_a, ls="--", c="k", lw=1,
               label=f"goal: {goals['vs_fastest_decode']}x fastest decode")
    ax.axvline(goals["vs_fastest_hf"] * fastest_b, ls=":", c="tab:red", lw=1,
               label=f"goal: {goals['vs_fastest_hf']:g}x fastest HF")
    ax.set_xlabel("images/s, one core")
    ax.set_title(f"{rep['photos']['count']} JPEGs, {rep['photos']['megapixels_min']}-"
                 f"{rep['photos']['megapixels_max']} MP: (a) decode, (a+) decode + resize, (b) HF, (c) ours, (r) rank", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    prof = rep["profile_ours"]
    left = 0.0
    for stage, v in prof.items():
        bx.barh(["ours to\npixel_values"], [v["seconds"]], left=left, label=stage)
        left += v["seconds"]
    bx.set_xlabel("seconds for all images, one core")
    bx.set_title("our path by stage (the rank does to_pixel_values)", fontsize=10)
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_decode(rep: dict) -> None:
    ph = rep["photos"]
    print(f"\n{ph['count']} JPEG photos, {ph['megapixels_min']}-{ph['megapixels_max']} MP "
          f"(mean {ph['megapixels_mean']}), {ph['bytes_per_pixel']} B/px; one thread each; "
          f"max_pixels={rep['vision']['max_pixels']} (resize: {ph['resize']})")
    print(f"{'':3} {'method':28} {'img/s':>9} {'MP/s':>9} {'x fastest(a)':>13} {'ours(c) / this':>15}")
    fa = rep["results"][rep["fastest_decode"]]["images_per_s"]
    ours = rep["results"]["ours_pixel_values"]["images_per_s"]
    for name, r in rep["results"].items():
        print(f"({r['group']}) {name:28} {r['images_per_s']:9.2f} {r['mp_per_s']:9.1f} "
              f"{r['images_per_s'] / fa:13.3f} {ours / r['images_per_s']:15.2f}")
    g = rep["goals"]
    for c, rr in rep["ratios"].items():
        print(f"{c}: {rr['vs_fastest_decode']:.3f}x fastest decode ({rep['fastest_decode']}, goal >= "
              f"{g['vs_fastest_decode']}), {rr['vs_fastest_hf']:.2f}x fastest HF ({rep['fastest_hf']}, goal >= "
              f"{g['vs_fastest_hf']})" + (f", {rr['vs_hf_pil']:.1f}x HF PIL" if "vs_hf_pil" in rr else "")
              + (f", {rr['vs_decode_and_resize']:.3f}x decode + resize" if "vs_decode_and_resize" in rr else ""))
    for key, what in (("vs_fastest_decode_by_round", "fastest decode"), ("vs_fastest_hf_by_round", "fastest HF")):
        r = g.get(key)
        if r:
            print(f"{GOAL_PATH} x {what}, round by round: median {r['ratio_median']:.3f} "
                  f"(range {r['ratio_min']:.3f}-{r['ratio_max']:.3f}, {r['rounds']} rounds)")
    print("profile of ours (pixel_values), share of time: " +
          ", ".join(f"{k} {v['share'] * 100:.0f}% ({v['seconds']:.3f}s)" for k, v in rep["profile_ours"].items()
              if "share" in v))
    a = rep["actors_patch_order_over_pixel_rows"]
    print(f"the actors' CPU time per image, patch order in the actor over pixel rows: {a['ratio_median']:.2f}x "
          f"(median of {a['rounds']} alternated rounds, range {a['ratio_min']:.2f}-{a['ratio_max']:.2f})")
    d = rep.get("dali_decode_cpu_over_torchvision")
    if d:
        print(f"DALI's CPU decode over torchvision's, process CPU time: {d['ratio_median']:.2f}x "
              f"(median of {d['rounds']} alternated rounds, range {d['ratio_min']:.2f}-{d['ratio_max']:.2f})")
    for key, what in (("dali_decode_cpu_over_torchvision_and_copy",
                       "DALI's decode, over torchvision's decode and one copy of its frame"),
                      ("actors_cpu_over_decode_and_resize", "the actors resizing, over libjpeg-turbo decode + OpenCV resize"),
                      ("actors_cpu_over_raw_decode", f"the actors (resize_on={rep.get('resize_on')}) over torchvision's decode"),
                      ("actors_resizing_cpu_over_default", "the actors resizing every image, over the default"),
                      ("actors_copying_rows_cpu_over_default", "the actors copying each image's rows once, over the default")):
        f = rep.get(key)
        if f:
            print(f"CPU time, {what}: {f['ratio_median']:.2f}x "
                  f"(median of {f['rounds']} alternated rounds, range {f['ratio_min']:.2f}-{f['ratio_max']:.2f})")
    rank = rep["results"].get("rank_resize_torch_cpu")
    if rank:
        both = 1 / (1 / rep["results"][GOAL_PATH]["images_per_s"] + 1 / rank["images_per_s"])
        print(f"a CPU-only box, the actors' work plus the rank's resize on one core: {both:.1f} img/s "
              f"({both / fa:.3f}x fastest decode)")
    pk = rep.get("packing") or {}
    if pk:
        print(f"\npacking ({pk['sources']}, max_pixels={pk['max_pixels']}, "
              f"tokens/sample mean {pk['tokens_per_sample']['mean']:.0f}, max {pk['tokens_per_sample']['max']}):")
        print(f"  {'seq_len':>8} {'packed eff':>11} {'padded eff':>11} {'rows packed':>12} {'rows padded':>12} {'too long':>9}")
        for k, v in pk.items():
            if k.isdigit():
                print(f"  {k:>8} {v['packing_efficiency']:11.3f} {v['padding_efficiency']:11.3f} "
                      f"{v['rows_packed']:12d} {v['rows_padded']:12d} {v['too_long']:9d}")
