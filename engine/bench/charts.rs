//! Charts written as SVG with plotters (no font files needed: SVG text is rendered by the
//! viewer), each also rasterized into a PNG beside it with resvg (text drawn with the system's
//! fonts, left out where none is installed).

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;
use std::path::PathBuf;

use crate::cache::replay::ReplayResult;
use crate::error::{Error, Result};
use crate::ids::ExpertId;
use crate::ids::Stack;

/// Rasterizes the SVG chart `svg` into `svg` with a `.png` extension.
pub fn png_beside(svg: &Path) -> Result<PathBuf> {
    let png = svg.with_extension("png");
    let text = std::fs::read_to_string(svg).map_err(|e| Error::io(svg, e))?;
    let mut options = resvg::usvg::Options::default();
    options.fontdb_mut().load_system_fonts();
    options.fontdb_mut().set_sans_serif_family("DejaVu Sans");
    let tree = resvg::usvg::Tree::from_str(&text, &options)
        .map_err(|e| Error::format(svg, format!("cannot read the chart back: {e}")))?;
    let size = tree.size().to_int_size();
    let mut pixmap = resvg::tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| Error::format(svg, "empty chart"))?;
    resvg::render(
        &tree,
        resvg::tiny_skia::Transform::default(),
        &mut pixmap.as_mut(),
    );
    pixmap
        .save_png(&png)
        .map_err(|e| Error::format(&png, format!("cannot write the PNG: {e}")))?;
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
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
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
    drop(root);
    png_beside(path)?;
    Ok(())
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
    let root = SVGBackend::new(path, (width, height)).into_drawing_area();
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
    drop(root);
    png_beside(path)?;
    Ok(())
}
