//! Plots (SVG, plotters): latency distributions per flow, the scale sweep,
//! the NAT under churn, the CNI calls.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::{Result, anyhow};
use plotters::prelude::*;
use vpcnet_lab::Datapath;

use crate::{
    loadgen::TICK,
    run::{Results, scale_name},
};

const SIZE: (u32, u32) = (900, 520);
const FONT: &str = "sans-serif";

fn color(datapath: Datapath) -> RGBColor {
    match datapath {
        Datapath::Routed => RGBColor(120, 120, 120),
        Datapath::Iptables => RGBColor(214, 96, 39),
        Datapath::Ebpf => RGBColor(31, 119, 180),
    }
}

fn plot_error<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing a plot: {e:?}")
}

/// A cumulative distribution from histogram buckets `(upper edge, count)`.
fn cdf(buckets: &BTreeMap<u64, (f64, u64)>) -> Vec<(f64, f64)> {
    let total: u64 = buckets.values().map(|(_, n)| n).sum();
    let mut seen = 0;
    buckets
        .values()
        .map(|&(edge, n)| {
            seen += n;
            (edge, seen as f64 / total.max(1) as f64)
        })
        .collect()
}

/// Every round's histogram of `name` in `datapath`, merged.
fn merged_histogram(
    results: &Results,
    datapath: Datapath,
    name: &str,
) -> BTreeMap<u64, (f64, u64)> {
    let mut buckets = BTreeMap::new();
    for m in results.of(datapath, name) {
        let Some(load) = &m.load else { continue };
        for &(edge, n) in &load.latency.histogram {
            // Keyed by the edge in nanoseconds: edges are the same values
            // whichever run they come from.
            let key = (edge * 1000.0).round() as u64;
            buckets.entry(key).or_insert((edge, 0)).1 += n;
        }
    }
    buckets
}

/// A line of a latency plot: its label and colour, and the measurement.
struct Line<'a> {
    label: String,
    color: RGBColor,
    datapath: Datapath,
    name: &'a str,
}

/// The same measurement in each datapath.
fn per_datapath<'a>(name: &'a str, datapaths: &[Datapath]) -> Vec<Line<'a>> {
    datapaths
        .iter()
        .map(|&datapath| Line {
            label: datapath.to_string(),
            color: color(datapath),
            datapath,
            name,
        })
        .collect()
}

/// The CDF of the latency of each line.
fn latency_plot(
    results: &Results,
    path: &Path,
    title: &str,
    lines: &[Line<'_>],
    unit_ms: bool,
) -> Result<()> {
    let series: Vec<(&Line<'_>, Vec<(f64, f64)>)> = lines
        .iter()
        .map(|line| {
            (
                line,
                cdf(&merged_histogram(results, line.datapath, line.name)),
            )
        })
        .filter(|(_, points)| !points.is_empty())
        .collect();
    let scale = if unit_ms { 1e-3 } else { 1.0 };
    let (lo, hi) = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0 * scale))
        .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if series.is_empty() {
        return Ok(());
    }
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((lo * 0.9..hi * 1.1).log_scale(), 0.0..1.0)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc(if unit_ms {
            "milliseconds (log)"
        } else {
            "microseconds (log)"
        })
        .y_desc("fraction of exchanges at or below")
        .draw()
        .map_err(plot_error)?;
    for (line, points) in series {
        let style = line.color.stroke_width(2);
        chart
            .draw_series(LineSeries::new(
                points.into_iter().map(|(x, y)| (x * scale, y)),
                style,
            ))
            .map_err(plot_error)?
            .label(line.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    root.present().map_err(plot_error)
}

/// SNAT RR p50 against the pods' worth of state, per datapath and
/// exclusion count.
fn scale_plot(results: &Results, path: &Path) -> Result<()> {
    let opts = &results.options;
    let mut series = Vec::new();
    for &datapath in &[Datapath::Iptables, Datapath::Ebpf] {
        for &exclusions in &opts.scale_exclusions {
            let points: Vec<(f64, f64)> = opts
                .scale_fillers
                .iter()
                .filter_map(|&fillers| {
                    let name = scale_name(fillers, exclusions);
                    Some((fillers as f64, results.median(datapath, &name, "p50_us")?))
                })
                .collect();
            series.push((datapath, exclusions, points));
        }
    }
    let xs = opts.scale_fillers.iter().map(|&f| f as f64);
    let (x_lo, x_hi) = xs.fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let y_hi = series
        .iter()
        .flat_map(|(_, _, points)| points.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    if y_hi <= 0.0 {
        return Ok(());
    }
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "SNAT RR p50 by pods' worth of state on the node",
            (FONT, 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((x_lo * 0.8..x_hi * 1.25).log_scale(), 0.0..y_hi * 1.15)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("pods' worth of routing state (log)")
        .y_desc("RR p50, microseconds")
        .draw()
        .map_err(plot_error)?;
    for (datapath, exclusions, points) in series {
        let dashed = exclusions > 0;
        let base = color(datapath);
        let style = if dashed {
            base.mix(0.55).stroke_width(2)
        } else {
            base.stroke_width(2)
        };
        chart
            .draw_series(LineSeries::new(points.clone(), style))
            .map_err(plot_error)?
            .label(format!("{datapath}, {exclusions} exclusions"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 4, style.filled())),
            )
            .map_err(plot_error)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    root.present().map_err(plot_error)
}

/// A datapath's connections opened and attempts failed, per second.
type ChurnLines = (Datapath, Vec<(f64, f64)>, Vec<(f64, f64)>);

/// New connections per second (solid) and failed attempts per second
/// (thin) over the churn, first round, per datapath.
fn churn_plot(results: &Results, path: &Path) -> Result<()> {
    let per_second = 1.0 / TICK.as_secs_f64();
    let series: Vec<ChurnLines> = [Datapath::Iptables, Datapath::Ebpf]
        .into_iter()
        .filter_map(|datapath| {
            let load = results
                .of(datapath, "nat_churn")
                .find_map(|m| m.load.as_ref())?;
            let at = |i: usize| i as f64 * TICK.as_secs_f64();
            let opened = load
                .timeline
                .iter()
                .enumerate()
                .map(|(i, t)| (at(i), t.0 as f64 * per_second))
                .collect();
            let failed = load
                .timeline
                .iter()
                .enumerate()
                .map(|(i, t)| (at(i), t.1 as f64 * per_second))
                .collect();
            Some((datapath, opened, failed))
        })
        .collect();
    let x_hi = series
        .iter()
        .filter_map(|(_, opened, _)| opened.last().map(|p| p.0))
        .fold(0.0, f64::max);
    let y_hi = series
        .iter()
        .flat_map(|(_, opened, failed)| opened.iter().chain(failed).map(|p| p.1))
        .fold(0.0, f64::max);
    if x_hi <= 0.0 || y_hi <= 0.0 {
        return Ok(());
    }
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "NAT under churn: connections kept to one inet address and port",
            (FONT, 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(0.0..x_hi * 1.02, 0.0..y_hi * 1.1)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("per second")
        .draw()
        .map_err(plot_error)?;
    for (datapath, opened, failed) in series {
        let style = color(datapath).stroke_width(2);
        chart
            .draw_series(LineSeries::new(opened, style))
            .map_err(plot_error)?
            .label(format!("{datapath}: connections opened"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        let thin = color(datapath).mix(0.6).stroke_width(1);
        chart
            .draw_series(LineSeries::new(failed, thin))
            .map_err(plot_error)?
            .label(format!("{datapath}: attempts failed"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], thin));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    root.present().map_err(plot_error)
}

/// Writes every plot into `dir`; returns the files written.
pub fn write_all(results: &Results, dir: &Path) -> Result<Vec<PathBuf>> {
    let all = [Datapath::Routed, Datapath::Iptables, Datapath::Ebpf];
    let mut written = Vec::new();
    let mut add = |name: &str, draw: &dyn Fn(&Path) -> Result<()>| -> Result<()> {
        let path = dir.join(name);
        draw(&path)?;
        if path.is_file() {
            written.push(path);
        }
        Ok(())
    };
    for (file, title, name) in [
        (
            "latency_snat_rr.svg",
            "SNAT (pod → inet) RR latency",
            "snat_rr",
        ),
        ("latency_pod_rr.svg", "pod → pod RR latency", "pod_rr"),
        (
            "latency_eni_rr.svg",
            "secondary-ENI pod → peer RR latency",
            "eni_rr",
        ),
        (
            "latency_snat_crr.svg",
            "SNAT CRR: connect, exchange, close",
            "snat_crr",
        ),
    ] {
        add(file, &|path| {
            latency_plot(results, path, title, &per_datapath(name, &all), false)
        })?;
    }
    add("scale.svg", &|path| scale_plot(results, path))?;
    add("nat_churn.svg", &|path| churn_plot(results, path))?;
    let cni = [
        ("plugin ADD", RGBColor(31, 119, 180), "cni_add"),
        ("plugin DEL", RGBColor(44, 160, 44), "cni_del"),
        (
            "RunPodSandbox",
            RGBColor(148, 103, 189),
            "cri_run_pod_sandbox",
        ),
        (
            "Stop+RemovePodSandbox",
            RGBColor(140, 86, 75),
            "cri_stop_remove_pod_sandbox",
        ),
    ]
    .map(|(label, color, name)| Line {
        label: label.to_owned(),
        color,
        datapath: Datapath::Ebpf,
        name,
    });
    add("cni.svg", &|path| {
        latency_plot(
            results,
            path,
            "CNI calls through containerd's CRI (vpcnet)",
            &cni,
            true,
        )
    })?;
    Ok(written)
}
