//! Charts written as SVG with plotters (no font files needed: SVG text is rendered by the
//! viewer), each also rasterized into a PNG beside it with resvg (text drawn with the system's
//! fonts, left out where none is installed): the bench matrix's latency charts, replayed hit
//! ratios, and the tuner's expert-importance heat map.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::bench::report::BenchRow;
use crate::cache::replay::ReplayResult;
use crate::error::{Error, Result};
use crate::ids::{ExpertId, Stack};
use crate::runtime::modes::Mode;
use crate::units::format_bytes;

/// Writes the SVG chart `text` to `svg` and its rasterization beside it (`svg` with a `.png`
/// extension), each atomically.
fn save_chart(svg: &Path, text: &str) -> Result<()> {
    crate::atomic::write_file(svg, text.as_bytes())?;
    png_beside(svg, text)?;
    Ok(())
}

/// Rasterizes the SVG chart `text` (of file `svg`) into `svg` with a `.png` extension.
pub fn png_beside(svg: &Path, text: &str) -> Result<PathBuf> {
    let png = svg.with_extension("png");
    let mut options = resvg::usvg::Options::default();
    options.fontdb_mut().load_system_fonts();
    options.fontdb_mut().set_sans_serif_family("DejaVu Sans");
    let tree = resvg::usvg::Tree::from_str(text, &options)
        .map_err(|e| Error::format(svg, format!("cannot read the chart back: {e}")))?;
    let size = tree.size().to_int_size();
    let mut pixmap = resvg::tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| Error::format(svg, "empty chart"))?;
    resvg::render(
        &tree,
        resvg::tiny_skia::Transform::default(),
        &mut pixmap.as_mut(),
    );
    let bytes = pixmap
        .encode_png()
        .map_err(|e| Error::format(&png, format!("cannot encode the PNG: {e}")))?;
    crate::atomic::write_file(&png, &bytes)?;
    Ok(png)
}

/// Hit ratio against buffer size, one line per policy (EdgeMoE Figure 13); Belady, the offline
/// optimum, is drawn as the dashed upper line.
pub fn hit_ratio_vs_slots(results: &[ReplayResult], title: &str, path: &Path) -> Result<()> {
    let plot_error = |e: String| Error::format(path, format!("cannot draw the chart: {e}"));
    let mut lines: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in results {
        lines
            .entry(r.policy.name().to_string())
            .or_default()
            .push((r.slots as f64, r.hit_ratio));
    }
    let max_slots = results.iter().map(|r| r.slots).max().unwrap_or(1) as f64;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (800, 500)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_error(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(20)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..max_slots * 1.05, 0f64..1.0)
            .map_err(|e| plot_error(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc("buffer size (experts)")
            .y_desc("hit ratio")
            .draw()
            .map_err(|e| plot_error(e.to_string()))?;
        for (i, (name, mut points)) in lines.into_iter().enumerate() {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = Palette99::pick(i).to_rgba();
            let style = if name == "belady" {
                BLACK.stroke_width(2)
            } else {
                color.stroke_width(2)
            };
            let series = if name == "belady" {
                chart.draw_series(DashedLineSeries::new(points.clone(), 6, 4, style))
            } else {
                chart.draw_series(LineSeries::new(points.clone(), style))
            }
            .map_err(|e| plot_error(e.to_string()))?;
            let legend_style = style;
            series
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], legend_style));
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 3, style.filled())))
                .map_err(|e| plot_error(e.to_string()))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(|e| plot_error(e.to_string()))?;
        root.present().map_err(|e| plot_error(e.to_string()))?;
    }
    save_chart(path, &svg)
}

/// Importance of each expert (loss when it alone goes to the lower width) as a heat map: one
/// row per MoE layer, one column per expert (EdgeMoE Figure 7a). Darker = more important.
pub fn importance_heatmap(
    importance: &BTreeMap<ExpertId, f64>,
    title: &str,
    path: &Path,
) -> Result<()> {
    let plot_error = |e: String| Error::format(path, format!("cannot draw the chart: {e}"));
    let mut layers: Vec<(Stack, u16)> = importance.keys().map(|id| (id.stack, id.layer)).collect();
    layers.dedup();
    let experts = importance
        .keys()
        .map(|id| id.expert as usize + 1)
        .max()
        .unwrap_or(1);
    let max = importance
        .values()
        .copied()
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let cell = 40u32;
    let width = 160 + cell * experts as u32 + 40;
    let height = 80 + cell * layers.len() as u32 + 60;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_error(e.to_string()))?;
        root.draw(&Text::new(title.to_string(), (20, 20), ("sans-serif", 18)))
            .map_err(|e| plot_error(e.to_string()))?;
        for (row, (stack, block)) in layers.iter().enumerate() {
            let y = 60 + row as i32 * cell as i32;
            root.draw(&Text::new(
                format!("{} block {block}", stack.hf_prefix()),
                (10, y + cell as i32 / 2 - 6),
                ("sans-serif", 13),
            ))
            .map_err(|e| plot_error(e.to_string()))?;
            for expert in 0..experts {
                let id = ExpertId {
                    stack: *stack,
                    layer: *block,
                    expert: expert as u16,
                };
                let Some(&value) = importance.get(&id) else {
                    continue;
                };
                let level = (value / max).clamp(0.0, 1.0);
                let shade = (255.0 * (1.0 - level)) as u8;
                let x = 160 + expert as i32 * cell as i32;
                root.draw(&Rectangle::new(
                    [(x, y), (x + cell as i32 - 2, y + cell as i32 - 2)],
                    RGBColor(255, shade, shade).filled(),
                ))
                .map_err(|e| plot_error(e.to_string()))?;
                root.draw(&Text::new(
                    format!("{:.2}", value),
                    (x + 4, y + cell as i32 / 2 - 6),
                    ("sans-serif", 10),
                ))
                .map_err(|e| plot_error(e.to_string()))?;
            }
        }
        let y = 60 + layers.len() as i32 * cell as i32 + 10;
        for expert in 0..experts {
            root.draw(&Text::new(
                format!("e{expert}"),
                (160 + expert as i32 * cell as i32 + 10, y),
                ("sans-serif", 12),
            ))
            .map_err(|e| plot_error(e.to_string()))?;
        }
        root.present().map_err(|e| plot_error(e.to_string()))?;
    }
    save_chart(path, &svg)
}

/// One colour per mode, the same in every chart.
fn mode_color(mode: &str) -> PaletteColor<Palette99> {
    Palette99::pick(Mode::ALL.iter().position(|m| m.name() == mode).unwrap_or(0))
}

fn chart_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::format(path, format!("cannot draw the chart: {e}"))
}

/// Per-token latency per mode at each budget (EdgeMoE Fig. 11/16 style bars).
pub fn plot_latency_bars(rows: &[BenchRow], title: &str, path: &Path) -> Result<()> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 500)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| chart_error(path, e))?;
        let labels: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{} {}",
                    r.mode,
                    r.buffer_experts
                        .map(|n| format!("{n}e"))
                        .unwrap_or_else(|| format_bytes(r.budget_bytes))
                )
            })
            .collect();
        let max = rows
            .iter()
            .map(|r| r.decode_ms_per_token)
            .fold(1.0, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(20)
            .x_label_area_size(120)
            .y_label_area_size(60)
            .build_cartesian_2d(0..rows.len(), 0f64..max * 1.1)
            .map_err(|e| chart_error(path, e))?;
        chart
            .configure_mesh()
            .y_desc("decode ms per token")
            .x_labels(rows.len())
            .x_label_formatter(&|i| labels.get(*i).cloned().unwrap_or_default())
            .x_label_style(
                ("sans-serif", 11)
                    .into_font()
                    .transform(FontTransform::Rotate270),
            )
            .draw()
            .map_err(|e| chart_error(path, e))?;
        chart
            .draw_series(rows.iter().enumerate().map(|(i, r)| {
                let color = mode_color(&r.mode);
                Rectangle::new([(i, 0.0), (i + 1, r.decode_ms_per_token)], color.filled())
            }))
            .map_err(|e| chart_error(path, e))?;
        root.present().map_err(|e| chart_error(path, e))?;
    }
    save_chart(path, &svg)
}

/// Latency against budget, one line per mode (EdgeMoE Fig. 14).
pub fn plot_latency_vs_budget(rows: &[BenchRow], title: &str, path: &Path) -> Result<()> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (800, 500)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| chart_error(path, e))?;
        let x = |r: &BenchRow| {
            r.buffer_experts
                .map(|n| n as f64)
                .unwrap_or(r.budget_bytes as f64 / (1u64 << 20) as f64)
        };
        let xmax = rows.iter().map(x).fold(1.0, f64::max);
        let ymax = rows
            .iter()
            .map(|r| r.decode_ms_per_token)
            .fold(1.0, f64::max);
        let by_experts = rows.iter().any(|r| r.buffer_experts.is_some());
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(20)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..xmax * 1.05, 0f64..ymax * 1.1)
            .map_err(|e| chart_error(path, e))?;
        chart
            .configure_mesh()
            .x_desc(if by_experts {
                "buffer (experts)"
            } else {
                "budget (MiB)"
            })
            .y_desc("decode ms per token")
            .draw()
            .map_err(|e| chart_error(path, e))?;
        for mode in Mode::ALL.iter() {
            let mut points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.mode == mode.name())
                .map(|r| (x(r), r.decode_ms_per_token))
                .collect();
            if points.is_empty() {
                continue;
            }
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = mode_color(mode.name()).stroke_width(2);
            chart
                .draw_series(LineSeries::new(points.clone(), color))
                .map_err(|e| chart_error(path, e))?
                .label(mode.name())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| chart_error(path, e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| chart_error(path, e))?;
        root.present().map_err(|e| chart_error(path, e))?;
    }
    save_chart(path, &svg)
}

/// Cumulative distribution of per-sample latency per mode (EdgeMoE Fig. 12), at the first
/// budget of each mode.
pub fn plot_sample_cdf(rows: &[BenchRow], title: &str, path: &Path) -> Result<()> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (800, 500)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| chart_error(path, e))?;
        let xmax = rows
            .iter()
            .flat_map(|r| r.sample_ms_all.iter().copied())
            .fold(1.0, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(20)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..xmax * 1.05, 0f64..1.0)
            .map_err(|e| chart_error(path, e))?;
        chart
            .configure_mesh()
            .x_desc("per-sample latency (ms)")
            .y_desc("CDF")
            .draw()
            .map_err(|e| chart_error(path, e))?;
        let mut seen = std::collections::HashSet::new();
        for r in rows {
            if !seen.insert(r.mode.clone()) {
                continue;
            }
            let mut v = r.sample_ms_all.clone();
            v.sort_by(|a, b| a.total_cmp(b));
            let n = v.len().max(1) as f64;
            let points: Vec<(f64, f64)> = v
                .iter()
                .enumerate()
                .map(|(i, &ms)| (ms, (i + 1) as f64 / n))
                .collect();
            let color = mode_color(&r.mode).stroke_width(2);
            chart
                .draw_series(LineSeries::new(points, color))
                .map_err(|e| chart_error(path, e))?
                .label(r.mode.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(|e| chart_error(path, e))?;
        root.present().map_err(|e| chart_error(path, e))?;
    }
    save_chart(path, &svg)
}
